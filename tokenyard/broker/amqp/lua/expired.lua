-- The leases to take over (the reaper's first step): those whose holder's liveness lapsed
-- (`live`, scored by when each lapses; a lapsed worker holding none is forgotten) and, with
-- `expired` "1", those whose deadline passed. A bounded number per lane, each with its holder
-- and token so the requeue that follows is fenced by them, and 1 where its holder lapsed (that
-- requeue asks for no past deadline). Entries whose job no longer runs (it ended, or was taken
-- back) are dropped from the set on the way.
-- KEYS: live; per item: leases
-- ARGV: now, max_entries, job_prefix, expired
-- Returns per item {{job_id, consumer, token, deliveries, lapsed}, ...}.
local now = tonumber(A.now)
local lapsed, holding, any = {}, {}, false
for _, worker in ipairs(redis.call('ZRANGEBYSCORE', K.live, '-inf', A.now)) do
  lapsed[worker], any = true, true
end
local out = {}
for i = 1, N do
  local k = item(i)
  local found = {}
  local rows = {}
  if any then  -- every lease of the lane: a lapsed worker's need not have expired
    rows = redis.call('ZRANGE', k.leases, 0, -1, 'WITHSCORES')
  elseif A.expired == '1' then
    rows = redis.call('ZRANGEBYSCORE', k.leases, '-inf', A.now, 'WITHSCORES', 'LIMIT', 0,
      A.max_entries)
  end
  for j = 1, #rows, 2 do
    local jid, deadline = rows[j], tonumber(rows[j + 1])
    local h = redis.call('HMGET', A.job_prefix .. jid, 'status', 'worker', 'lease', 'deliveries')
    if h[1] == 'running' and h[3] and h[3] ~= '' then
      local gone = lapsed[h[2]] and 1 or 0
      if gone == 1 then holding[h[2]] = true end
      if #found < tonumber(A.max_entries)
        and (gone == 1 or (A.expired == '1' and deadline <= now)) then
        found[#found + 1] = {jid, h[2], h[3], tonumber(h[4] or '0'), gone}
      end
    else
      redis.call('ZREM', k.leases, jid)
    end
  end
  out[i] = found
end
for worker in pairs(lapsed) do
  if not holding[worker] then redis.call('ZREM', K.live, worker) end
end
return out
