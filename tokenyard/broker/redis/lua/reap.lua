-- Take leased entries from their holders and requeue their jobs, or dead-letter them once they
-- reach the delivery limit: every entry pending for a worker whose liveness lapsed (`live`,
-- scored by when each lapses; a worker is forgotten once none of its entries is left) and,
-- with `expired` "1", every entry idle past the lease (XAUTOCLAIM). A job a client asked to
-- cancel while it ran ends cancelled instead. Bounded work per lane and worker, no lock: any
-- worker may run it.
-- KEYS: dlq, counters, live, cancels; per item: lane, home
-- ARGV: group, reaper, min_idle_ms, max_entries, max_deliveries, now, job_prefix,
--   event_prefix, finished, dead_error, cancelled, ttl_ms, expired; per item: priority
-- `home` is the lane a requeued job goes back to: the lane itself, or for a lane's affinity
-- stream (claim.lua) the lane, since only a claim may add to an affinity stream. `finished`
-- is Finished(dead result) with `dead_error`, `cancelled` Finished(cancelled result).
-- Returns {requeued_ids, dead_ids, cancelled_ids}.
local terminal = {succeeded = true, failed = true, cancelled = true, expired = true, dead = true}
local requeued, dead, cancelled = {}, {}, {}
local max_entries = tonumber(A.max_entries)

-- an entry taken from its holder (acked and deleted: the holder's writes are refused now)
local function move(k, a, eid, fields)
  redis.call('XACK', k.lane, A.group, eid)
  redis.call('XDEL', k.lane, eid)
  if not fields then return end
  local jid = fields[2]
  local jk = A.job_prefix .. jid
  local h = redis.call('HMGET', jk, 'status', 'deliveries', 'cancel')
  if not h[1] or terminal[h[1]] then return end
  local deliveries = tonumber(h[2] or '0')
  local ek = A.event_prefix .. jid
  if h[3] == '1' then
    finish(jk, ek, K.cancels, jid, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
    cancelled[#cancelled + 1] = jid
  elseif deliveries >= tonumber(A.max_deliveries) then
    redis.call('HSET', jk, 'last_error', A.dead_error)
    finish(jk, ek, K.cancels, jid, 'dead', A.finished, A.now, A.ttl_ms, '')
    bury(K.dlq, K.counters, jid, a.priority, 'lease_expired', A.dead_error, deliveries, A.now)
    dead[#dead + 1] = jid
  else
    redis.call('HSET', jk, 'status', 'queued')
    redis.call('XADD', k.home, '*', 'j', jid)
    requeued[#requeued + 1] = jid
  end
end

for _, worker in ipairs(redis.call('ZRANGEBYSCORE', K.live, '-inf', A.now)) do
  local left = false
  for i = 1, N do
    local k, a = item(i)
    local seen = 0
    repeat
      local p = redis.pcall('XPENDING', k.lane, A.group, '-', '+', 100, worker)
      if p.err then break end  -- no such lane, or nobody claimed from it yet
      for _, pending in ipairs(p) do
        local eid = pending[1]
        local entry = redis.call('XRANGE', k.lane, eid, eid)[1]
        move(k, a, eid, entry and entry[2])
      end
      seen = seen + #p
    until #p < 100 or seen >= max_entries
    left = left or seen >= max_entries
  end
  if not left then redis.call('ZREM', K.live, worker) end
end

if A.expired == '1' then
  for i = 1, N do
    local k, a = item(i)
    local cursor, seen = '0-0', 0
    repeat
      local r = redis.pcall('XAUTOCLAIM', k.lane, A.group, A.reaper, A.min_idle_ms, cursor,
        'COUNT', 100)
      if r.err then break end  -- no such lane, or nobody claimed from it yet: nothing leased
      cursor = r[1]
      for _, entry in ipairs(r[2]) do
        seen = seen + 1
        move(k, a, entry[1], entry[2])
      end
    until cursor == '0-0' or seen >= max_entries
  end
end
return {requeued, dead, cancelled}
