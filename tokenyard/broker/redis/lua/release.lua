-- Drain: hand jobs still ours back for immediate redelivery without charging a delivery; a job
-- a client asked to cancel while it ran ends cancelled instead. A preemption (machine.preempt)
-- is this release, counted in the record's `preempted` and refused once it reached
-- `max_preemptions` (the holder keeps the job and runs it to its end).
-- KEYS: cancels; per item: lane, job, home, events
-- ARGV: group, now, ttl_ms, cancelled, max_preemptions; per item: consumer, entry_id, job_id
-- `home` is the lane the job goes back to (for an affinity lease, not the affinity stream);
-- `cancelled` is Finished(cancelled result); `max_preemptions` -1: a plain release.
-- The job is added to its lane's stream again: that stream holds only the fair-share window
-- (lib/fair.lua), so it goes ahead of every job still staged, behind the window's few.
-- Returns one code per item: 1 released, 2 cancelled, 3 preempted too often, 0 no longer ours.
local bound = tonumber(A.max_preemptions)
local out = {}
for i = 1, N do
  local k, a = item(i)
  local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
  out[i] = 0
  if #p > 0 and p[1][2] == a.consumer then
    local cancel = redis.call('HGET', k.job, 'cancel') == '1'
    local spent = bound >= 0 and not cancel
      and tonumber(redis.call('HGET', k.job, 'preempted') or '0') >= bound
    if spent then
      out[i] = 3
    else
      redis.call('XACK', k.lane, A.group, a.entry_id)
      redis.call('XDEL', k.lane, a.entry_id)
      if cancel then
        finish(k.job, k.events, K.cancels, a.job_id, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
        out[i] = 2
      else
        redis.call('HSET', k.job, 'status', 'queued')
        redis.call('HINCRBY', k.job, 'deliveries', -1)
        if bound >= 0 then redis.call('HINCRBY', k.job, 'preempted', 1) end
        redis.call('XADD', k.home, '*', 'j', a.job_id)
        out[i] = 1
      end
    end
  end
end
return out
