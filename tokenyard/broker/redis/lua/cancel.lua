-- Cancel: a waiting job ends now; a running one is flagged for its worker's next step.
-- With `leaving` > 0 (live callers went away) the job's followers are counted down first, and
-- it is cancelled only when none is left (a collapsed job runs on for its other callers).
-- KEYS: job, events, cancels, delayed
-- ARGV: job_id, now, finished, ttl_ms, leaving
local status = redis.call('HGET', K.job, 'status')
if not status then return 'not_found' end
local leaving = tonumber(A.leaving)
if leaving > 0 and (status == 'queued' or status == 'running') then
  -- a job that never collapsed has no followers field: it drops below 1 and is cancelled
  if redis.call('HINCRBY', K.job, 'followers', -leaving) > 0 then return 'followed' end
end
if status == 'running' then
  redis.call('HSET', K.job, 'cancel', '1')
  redis.call('SADD', K.cancels, A.job_id)
  return 'signalled'
end
if status ~= 'queued' then return 'already_finished' end
-- its lane entry, if any, is dropped when a worker reads it
redis.call('ZREM', K.delayed, A.job_id)
redis.call('HSET', K.job, 'cancel', '1')
finish(K.job, K.events, nil, A.job_id, 'cancelled', A.finished, A.now, A.ttl_ms, '')
return 'cancelled'
