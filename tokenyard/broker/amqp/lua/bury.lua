-- Dead-letter jobs: the lease holder gives up (`token`), or RabbitMQ dead-lettered the job's
-- message past its delivery limit (`msg`: only while the record still names that message).
-- KEYS: dlq, counters, cancels, delayed; per item: job, events, waiting, leases
-- ARGV: now, ttl_ms; per item: job_id, consumer, token, msg, reason, error, finished, priority,
--   cancelled
-- A retry past the limit passes `cancelled` (Finished(cancelled result)): a job a client asked
-- to cancel ends cancelled instead of dead.
-- Returns one code per item: 1 dead-lettered, 2 cancelled, 0 fenced off (or already ended).
local out = {}
for i = 1, N do
  local k, a = item(i)
  local h = redis.call('HMGET', k.job, 'status', 'msg', 'deliveries', 'cancel')
  local ok
  if a.token ~= '' then
    ok = holds(k.job, a.consumer, a.token)
  else
    ok = (h[1] == 'queued' or h[1] == 'running') and h[2] == a.msg
  end
  if ok and a.cancelled ~= '' and h[4] == '1' then
    redis.call('HSET', k.job, 'lease', '')
    finish(k.job, k.events, K.cancels, a.job_id, 'cancelled', a.cancelled, A.now, A.ttl_ms, '')
    redis.call('ZREM', k.leases, a.job_id)
    redis.call('ZREM', K.delayed, a.job_id)
    out[i] = 2
  elseif ok then
    redis.call('HSET', k.job, 'last_error', a.error, 'lease', '')
    finish(k.job, k.events, K.cancels, a.job_id, 'dead', a.finished, A.now, A.ttl_ms, '')
    bury(K.dlq, K.counters, a.job_id, a.priority, a.reason, a.error, tonumber(h[3] or '0'), A.now)
    redis.call('ZREM', k.leases, a.job_id)
    redis.call('ZREM', k.waiting, a.job_id)
    redis.call('ZREM', K.delayed, a.job_id)
    out[i] = 1
  else
    if a.token ~= '' then redis.call('HINCRBY', K.counters, 'fenced', 1) end
    out[i] = 0
  end
end
return out
