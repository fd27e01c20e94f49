-- Fenced completion of a batch: a job's lease must still be the caller's; its terminal result
-- is written once, then the lease is gone (a second completion is fenced off too).
-- KEYS: cancels, counters; per item: job, events, leases
-- ARGV: now, ttl_ms; per item: consumer, token, job_id, status, finished, tail
-- `finished` is the Finished event, stored as the record's result too; `tail` the last token
-- chunk, or ''. Returns one flag per item: 1 accepted, 0 fenced off.
local accepted = {}
for i = 1, N do
  local k, a = item(i)
  if not holds(k.job, a.consumer, a.token) then
    redis.call('HINCRBY', K.counters, 'fenced', 1)
    accepted[i] = 0
  else
    redis.call('HSET', k.job, 'lease', '')
    finish(k.job, k.events, K.cancels, a.job_id, a.status, a.finished, A.now, A.ttl_ms, a.tail)
    redis.call('ZREM', k.leases, a.job_id)
    accepted[i] = 1
  end
end
return accepted
