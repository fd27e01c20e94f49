-- Cancel: a waiting job ends now; a running one is flagged for its worker's next step.
-- KEYS: job, events, cancels, delayed
-- ARGV: job_id, now, finished, ttl_ms
local status = redis.call('HGET', K.job, 'status')
if not status then return 'not_found' end
if status == 'running' then
  redis.call('HSET', K.job, 'cancel', '1')
  redis.call('SADD', K.cancels, A.job_id)
  return 'signalled'
end
if status ~= 'queued' then return 'already_finished' end
-- its lane entry, if any, is dropped when a worker reads it
redis.call('ZREM', K.delayed, A.job_id)
redis.call('HSET', K.job, 'status', 'cancelled', 'cancel', '1', 'result', A.finished,
  'end_at', A.now)
redis.call('XADD', K.events, '*', 'e', A.finished)
redis.call('PEXPIRE', K.job, A.ttl_ms)
redis.call('PEXPIRE', K.events, A.ttl_ms)
return 'cancelled'
