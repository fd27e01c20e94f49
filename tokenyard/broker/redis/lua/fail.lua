-- A delivery failed: retry after backoff, or dead-letter when forced or past the limit; a job a
-- client asked to cancel while it ran ends cancelled instead of running again.
-- KEYS: lane, job, events, cancels, counters, delayed, dlq
-- ARGV: group, consumer, entry_id, job_id, error, now, due_at, max_deliveries, finished,
--   ttl_ms, reason, force_dead, priority, cancelled
-- `finished` is Finished(dead result), `cancelled` Finished(cancelled result).
-- Returns 1 retrying, 0 dead-lettered, 2 cancelled, -1 fenced off.
local p = redis.call('XPENDING', K.lane, A.group, A.entry_id, A.entry_id, 1)
if #p == 0 or p[1][2] ~= A.consumer then
  redis.call('HINCRBY', K.counters, 'fenced', 1)
  return -1
end
redis.call('XACK', K.lane, A.group, A.entry_id)
redis.call('XDEL', K.lane, A.entry_id)
local h = redis.call('HMGET', K.job, 'deliveries', 'cancel')
local deliveries = tonumber(h[1] or '0')
if A.force_dead ~= '1' and h[2] == '1' then
  finish(K.job, K.events, K.cancels, A.job_id, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
  return 2
end
if A.force_dead ~= '1' and deliveries < tonumber(A.max_deliveries) then
  redis.call('HSET', K.job, 'status', 'queued', 'last_error', A.error)
  redis.call('ZADD', K.delayed, A.due_at, A.job_id)
  return 1
end
redis.call('HSET', K.job, 'last_error', A.error)
finish(K.job, K.events, K.cancels, A.job_id, 'dead', A.finished, A.now, A.ttl_ms, '')
bury(K.dlq, K.counters, A.job_id, A.priority, A.reason, A.error, deliveries, A.now)
return 0
