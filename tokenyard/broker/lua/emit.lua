-- Append one event to a job's stream, fenced: only the lease holder may speak for the job.
-- KEYS: lane, events   ARGV: group, consumer, entry_id, event
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XADD', KEYS[2], '*', 'e', ARGV[4])
return 1
