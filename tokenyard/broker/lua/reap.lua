-- Reclaim entries idle past the lease with XAUTOCLAIM; requeue them, or dead-letter them once
-- they reach the delivery limit. Bounded work per call, no lock: any worker may run it.
-- KEYS: lane, dlq, counters
-- ARGV: group, reaper, min_idle_ms, max_entries, max_deliveries, now, job_prefix, event_prefix,
--       dead_result, dead_event, ttl_ms
-- Returns {requeued_ids, dead_ids}.
local lane, group = KEYS[1], ARGV[1]
local terminal = {succeeded = true, failed = true, cancelled = true, expired = true, dead = true}
local requeued, dead = {}, {}
local cursor, seen = '0-0', 0
repeat
  local r = redis.call('XAUTOCLAIM', lane, group, ARGV[2], ARGV[3], cursor, 'COUNT', 100)
  cursor = r[1]
  for _, entry in ipairs(r[2]) do
    local eid, fields = entry[1], entry[2]
    seen = seen + 1
    redis.call('XACK', lane, group, eid)
    redis.call('XDEL', lane, eid)
    if fields then
      local jid = fields[2]
      local jk = ARGV[7] .. jid
      local h = redis.call('HMGET', jk, 'status', 'deliveries')
      if h[1] and not terminal[h[1]] then
        local deliveries = tonumber(h[2] or '0')
        if deliveries >= tonumber(ARGV[5]) then
          local reason = 'lease expired on each of ' .. deliveries .. ' deliveries'
          redis.call('HSET', jk, 'status', 'dead', 'result', ARGV[9], 'end_at', ARGV[6],
            'last_error', reason)
          redis.call('XADD', KEYS[2], '*', 'job', jid, 'lane', lane, 'reason', 'lease_expired',
            'error', reason, 'deliveries', deliveries, 'at', ARGV[6])
          local ek = ARGV[8] .. jid
          redis.call('XADD', ek, '*', 'e', ARGV[10])
          redis.call('PEXPIRE', jk, ARGV[11])
          redis.call('PEXPIRE', ek, ARGV[11])
          redis.call('HINCRBY', KEYS[3], 'dead', 1)
          dead[#dead + 1] = jid
        else
          redis.call('HSET', jk, 'status', 'queued')
          redis.call('XADD', lane, '*', 'j', jid)
          requeued[#requeued + 1] = jid
        end
      end
    end
  end
until cursor == '0-0' or seen >= tonumber(ARGV[4])
return {requeued, dead}
