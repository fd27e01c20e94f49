-- Drain: hand jobs still ours back for immediate redelivery without charging a delivery.
-- KEYS: none; per item: lane, job, home
-- ARGV: group; per item: consumer, entry_id, job_id
-- `home` is the lane the job goes back to (for an affinity lease, not the affinity stream).
-- Returns how many were still ours.
local released = 0
for i = 1, N do
  local k, a = item(i)
  local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
  if #p > 0 and p[1][2] == a.consumer then
    redis.call('XACK', k.lane, A.group, a.entry_id)
    redis.call('XDEL', k.lane, a.entry_id)
    redis.call('HSET', k.job, 'status', 'queued')
    redis.call('HINCRBY', k.job, 'deliveries', -1)
    redis.call('XADD', k.home, '*', 'j', a.job_id)
    released = released + 1
  end
end
return released
