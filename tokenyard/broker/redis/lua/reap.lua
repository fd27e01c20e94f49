-- Reclaim entries idle past the lease with XAUTOCLAIM; requeue them, or dead-letter them once
-- they reach the delivery limit. Bounded work per lane, no lock: any worker may run it.
-- KEYS: dlq, counters; per item: lane, home
-- ARGV: group, reaper, min_idle_ms, max_entries, max_deliveries, now, job_prefix,
--   event_prefix, finished, ttl_ms; per item: priority
-- `home` is the lane a requeued job goes back to: the lane itself, or for a lane's affinity
-- stream (claim.lua) the lane, since only a claim may add to an affinity stream.
-- Returns {requeued_ids, dead_ids}.
local terminal = {succeeded = true, failed = true, cancelled = true, expired = true, dead = true}
local requeued, dead = {}, {}
for i = 1, N do
  local k, a = item(i)
  local lane = k.lane
  local cursor, seen = '0-0', 0
  repeat
    local r = redis.pcall('XAUTOCLAIM', lane, A.group, A.reaper, A.min_idle_ms, cursor,
      'COUNT', 100)
    if r.err then break end  -- no such lane, or nobody claimed from it yet: nothing leased
    cursor = r[1]
    for _, entry in ipairs(r[2]) do
      local eid, fields = entry[1], entry[2]
      seen = seen + 1
      redis.call('XACK', lane, A.group, eid)
      redis.call('XDEL', lane, eid)
      if fields then
        local jid = fields[2]
        local jk = A.job_prefix .. jid
        local h = redis.call('HMGET', jk, 'status', 'deliveries')
        if h[1] and not terminal[h[1]] then
          local deliveries = tonumber(h[2] or '0')
          if deliveries >= tonumber(A.max_deliveries) then
            local reason = 'lease expired on each of ' .. deliveries .. ' deliveries'
            redis.call('HSET', jk, 'status', 'dead', 'result', A.finished, 'end_at', A.now,
              'last_error', reason)
            redis.call('XADD', K.dlq, '*', 'job', jid, 'priority', a.priority,
              'reason', 'lease_expired', 'error', reason, 'deliveries', deliveries, 'at', A.now)
            local ek = A.event_prefix .. jid
            redis.call('XADD', ek, '*', 'e', A.finished)
            redis.call('PEXPIRE', jk, A.ttl_ms)
            redis.call('PEXPIRE', ek, A.ttl_ms)
            redis.call('HINCRBY', K.counters, 'dead', 1)
            dead[#dead + 1] = jid
          else
            redis.call('HSET', jk, 'status', 'queued')
            redis.call('XADD', k.home, '*', 'j', jid)
            requeued[#requeued + 1] = jid
          end
        end
      end
    end
  until cursor == '0-0' or seen >= tonumber(A.max_entries)
end
return {requeued, dead}
