-- Put held jobs back under the new message the caller already published (to the lane, or to a
-- delay queue for a retry): the record names that message, so the old one is stale; the lease
-- ends. Fenced by the lease token; with `expired_by` > 0 only a lease whose deadline is still
-- past (the reaper's: a renewal that came meanwhile wins).
-- A job a client asked to cancel while it ran ends cancelled instead (its new message is stale).
-- KEYS: delayed, cancels; per item: job, events, waiting, leases
-- ARGV: now, expired_by, ttl_ms, cancelled, max_preemptions; per item: consumer, token, job_id,
--   msg, uncharge, error, due_at
-- `uncharge` 1 hands a delivery back (drain); `due_at` > 0 is a retry's, else it waits now;
-- `cancelled` is Finished(cancelled result). `max_preemptions` >= 0 makes an uncharged
-- hand-back a preemption (machine.preempt): counted in `preempted`, and refused once it
-- reached the bound (the holder keeps its lease; the new message is stale and take.lua drops
-- it). -1: not a preemption.
-- Returns one code per item: 1 requeued, 2 cancelled, 3 preempted too often, 0 fenced off.
local bound = tonumber(A.max_preemptions)
local done = {}
for i = 1, N do
  local k, a = item(i)
  local ok = holds(k.job, a.consumer, a.token)
  if ok and tonumber(A.expired_by) > 0 then
    local deadline = redis.call('ZSCORE', k.leases, a.job_id)
    ok = deadline and tonumber(deadline) <= tonumber(A.expired_by)
  end
  local cancel = ok and redis.call('HGET', k.job, 'cancel') == '1'
  if ok and not cancel and bound >= 0
    and tonumber(redis.call('HGET', k.job, 'preempted') or '0') >= bound then
    done[i] = 3
  elseif cancel then
    redis.call('HSET', k.job, 'lease', '')
    finish(k.job, k.events, K.cancels, a.job_id, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
    redis.call('ZREM', k.leases, a.job_id)
    done[i] = 2
  elseif ok then
    redis.call('HSET', k.job, 'status', 'queued', 'msg', a.msg, 'lease', '')
    if a.error ~= '' then redis.call('HSET', k.job, 'last_error', a.error) end
    if a.uncharge == '1' then redis.call('HINCRBY', k.job, 'deliveries', -1) end
    if bound >= 0 then redis.call('HINCRBY', k.job, 'preempted', 1) end
    redis.call('ZREM', k.leases, a.job_id)
    if tonumber(a.due_at) > 0 then
      redis.call('ZADD', K.delayed, a.due_at, a.job_id)
    else
      redis.call('ZADD', k.waiting, A.now, a.job_id)
    end
    done[i] = 1
  else
    done[i] = 0
  end
end
return done
