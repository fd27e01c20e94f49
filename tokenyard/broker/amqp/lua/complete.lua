-- Fenced completion of a batch: a job's lease must still be the caller's; its terminal result
-- is written once, then the lease is gone (a second completion is fenced off too).
-- KEYS: cancels, counters; per item: job, events, leases
-- ARGV: now, ttl_ms; per item: consumer, entry_id, job_id, status, finished, tail
-- `finished` is the Finished event, stored as the record's result too; `tail` the last token
-- chunk, or ''. Returns one flag per item: 1 accepted, 0 fenced off.
local accepted = {}
for i = 1, N do
  local k, a = item(i)
  -- holds(), inline: the same read brings the record's cancel flag
  local h = redis.call('HMGET', k.job, 'status', 'worker', 'lease', 'cancel')
  if not (h[1] == 'running' and h[2] == a.consumer and h[3] == a.entry_id) then
    redis.call('HINCRBY', K.counters, 'fenced', 1)
    accepted[i] = 0
  else
    redis.call('HSET', k.job, 'lease', '')
    -- a cancel request is in the model's `cancels` set only where the record carries it
    -- (cancel.lua flags both at once): an SREM for every other job would be a command for nothing
    local cancels = h[4] == '1' and K.cancels or nil
    finish(k.job, k.events, cancels, a.job_id, a.status, a.finished, A.now, A.ttl_ms, a.tail)
    redis.call('ZREM', k.leases, a.job_id)
    accepted[i] = 1
  end
end
return accepted
