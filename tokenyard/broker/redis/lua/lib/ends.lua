-- A job's end, the one terminal write every script makes (the rule: tokenyard/broker/machine.py):
-- the record ends with `finished` (the Finished event, stored as its result too) after the
-- `tail` chunk ('' for none), both expire `ttl_ms` later, and a cancel request it carried is
-- dropped from its model's `cancels` set (nil: the caller knows there is none).
local function finish(job, events, cancels, job_id, status, finished, now, ttl_ms, tail)
  redis.call('HSET', job, 'status', status, 'result', finished, 'end_at', now)
  if tail ~= '' then redis.call('XADD', events, '*', 'e', tail) end
  redis.call('XADD', events, '*', 'e', finished)
  redis.call('PEXPIRE', job, ttl_ms)
  redis.call('PEXPIRE', events, ttl_ms)
  if cancels then redis.call('SREM', cancels, job_id) end
end

-- A dead-lettered job's entry in its model's dead-letter stream, counted (its record ends
-- through `finish`).
local function bury(dlq, counters, job_id, priority, reason, err, deliveries, now)
  redis.call('XADD', dlq, '*', 'job', job_id, 'priority', priority, 'reason', reason,
    'error', err, 'deliveries', deliveries, 'at', now)
  redis.call('HINCRBY', counters, 'dead', 1)
end
