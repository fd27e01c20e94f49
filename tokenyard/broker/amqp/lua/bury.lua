-- Dead-letter jobs: the lease holder gives up (`token`), or RabbitMQ dead-lettered the job's
-- message past its delivery limit (`msg`: only while the record still names that message).
-- KEYS: dlq, counters, cancels, delayed; per item: job, events, leases, waiting
-- ARGV: now, ttl_ms; per item: job_id, consumer, token, msg, reason, error, finished, priority
-- Returns one flag per item: 1 dead-lettered, 0 fenced off (or already ended).
local out = {}
for i = 1, N do
  local k, a = item(i)
  local h = redis.call('HMGET', k.job, 'status', 'msg', 'deliveries')
  local ok
  if a.token ~= '' then
    ok = holds(k.job, a.consumer, a.token)
  else
    ok = (h[1] == 'queued' or h[1] == 'running') and h[2] == a.msg
  end
  if ok then
    redis.call('HSET', k.job, 'status', 'dead', 'result', a.finished, 'last_error', a.error,
      'end_at', A.now, 'lease', '')
    redis.call('XADD', K.dlq, '*', 'job', a.job_id, 'priority', a.priority, 'reason', a.reason,
      'error', a.error, 'deliveries', tonumber(h[3] or '0'), 'at', A.now)
    redis.call('XADD', k.events, '*', 'e', a.finished)
    redis.call('PEXPIRE', k.job, A.ttl_ms)
    redis.call('PEXPIRE', k.events, A.ttl_ms)
    redis.call('ZREM', k.leases, a.job_id)
    redis.call('ZREM', k.waiting, a.job_id)
    redis.call('ZREM', K.delayed, a.job_id)
    redis.call('SREM', K.cancels, a.job_id)
    redis.call('HINCRBY', K.counters, 'dead', 1)
    out[i] = 1
  else
    if a.token ~= '' then redis.call('HINCRBY', K.counters, 'fenced', 1) end
    out[i] = 0
  end
end
return out
