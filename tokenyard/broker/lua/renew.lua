-- Extend a lease only if the entry is still ours: XCLAIM with min-idle 0 resets its idle time.
-- KEYS: lane   ARGV: group, consumer, entry_id
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[3], 'JUSTID')
return 1
