-- Extend leases only where the entry is still ours: XCLAIM with min-idle 0 resets its idle time.
-- KEYS: none; per item: lane
-- ARGV: group; per item: consumer, entry_id
-- Returns one flag per item: 1 renewed, 0 lost.
local renewed = {}
for i = 1, N do
  local k, a = item(i)
  local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
  if #p == 0 or p[1][2] ~= a.consumer then
    renewed[i] = 0
  else
    redis.call('XCLAIM', k.lane, A.group, a.consumer, 0, a.entry_id, 'JUSTID')
    renewed[i] = 1
  end
end
return renewed
