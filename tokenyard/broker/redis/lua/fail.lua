-- A delivery failed: retry after backoff, or dead-letter when forced or past the limit.
-- KEYS: lane, job, events, cancels, counters, delayed, dlq
-- ARGV: group, consumer, entry_id, job_id, error, now, due_at, max_deliveries, finished,
--   ttl_ms, reason, force_dead, priority
-- Returns 1 retrying, 0 dead-lettered, -1 fenced off.
local p = redis.call('XPENDING', K.lane, A.group, A.entry_id, A.entry_id, 1)
if #p == 0 or p[1][2] ~= A.consumer then
  redis.call('HINCRBY', K.counters, 'fenced', 1)
  return -1
end
redis.call('XACK', K.lane, A.group, A.entry_id)
redis.call('XDEL', K.lane, A.entry_id)
local deliveries = tonumber(redis.call('HGET', K.job, 'deliveries') or '0')
if A.force_dead ~= '1' and deliveries < tonumber(A.max_deliveries) then
  redis.call('HSET', K.job, 'status', 'queued', 'last_error', A.error)
  redis.call('ZADD', K.delayed, A.due_at, A.job_id)
  return 1
end
redis.call('HSET', K.job, 'status', 'dead', 'result', A.finished, 'last_error', A.error,
  'end_at', A.now)
redis.call('XADD', K.dlq, '*', 'job', A.job_id, 'priority', A.priority, 'reason', A.reason,
  'error', A.error, 'deliveries', deliveries, 'at', A.now)
redis.call('XADD', K.events, '*', 'e', A.finished)
redis.call('PEXPIRE', K.job, A.ttl_ms)
redis.call('PEXPIRE', K.events, A.ttl_ms)
redis.call('SREM', K.cancels, A.job_id)
redis.call('HINCRBY', K.counters, 'dead', 1)
return 0
