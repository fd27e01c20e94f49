-- Drain: hand jobs still ours back for immediate redelivery without charging a delivery; a job
-- a client asked to cancel while it ran ends cancelled instead.
-- KEYS: cancels; per item: lane, job, home, events
-- ARGV: group, now, ttl_ms, cancelled; per item: consumer, entry_id, job_id
-- `home` is the lane the job goes back to (for an affinity lease, not the affinity stream);
-- `cancelled` is Finished(cancelled result).
-- Returns one code per item: 1 released, 2 cancelled, 0 no longer ours.
local out = {}
for i = 1, N do
  local k, a = item(i)
  local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
  out[i] = 0
  if #p > 0 and p[1][2] == a.consumer then
    redis.call('XACK', k.lane, A.group, a.entry_id)
    redis.call('XDEL', k.lane, a.entry_id)
    if redis.call('HGET', k.job, 'cancel') == '1' then
      finish(k.job, k.events, K.cancels, a.job_id, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
      out[i] = 2
    else
      redis.call('HSET', k.job, 'status', 'queued')
      redis.call('HINCRBY', k.job, 'deliveries', -1)
      redis.call('XADD', k.home, '*', 'j', a.job_id)
      out[i] = 1
    end
  end
end
return out
