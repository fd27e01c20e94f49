-- The leases whose deadline passed (the reaper's first step): a bounded number per lane, each
-- with its holder and token so the requeue that follows is fenced by them. Entries whose job no
-- longer runs (it ended, or was taken back) are dropped from the set on the way.
-- KEYS: none; per item: leases
-- ARGV: now, max_entries, job_prefix
-- Returns per item {{job_id, consumer, token, deliveries}, ...}.
local out = {}
for i = 1, N do
  local k = item(i)
  local found = {}
  local ids = redis.call('ZRANGEBYSCORE', k.leases, '-inf', A.now, 'LIMIT', 0, A.max_entries)
  for _, jid in ipairs(ids) do
    local h = redis.call('HMGET', A.job_prefix .. jid, 'status', 'worker', 'lease', 'deliveries')
    if h[1] == 'running' and h[3] and h[3] ~= '' then
      found[#found + 1] = {jid, h[2], h[3], tonumber(h[4] or '0')}
    else
      redis.call('ZREM', k.leases, jid)
    end
  end
  out[i] = found
end
return out
