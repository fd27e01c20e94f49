-- Drain: hand a job still ours back for immediate redelivery without charging a delivery.
-- KEYS: lane, job   ARGV: group, consumer, entry_id, job_id
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then return 0 end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('HSET', KEYS[2], 'status', 'queued')
redis.call('HINCRBY', KEYS[2], 'deliveries', -1)
redis.call('XADD', KEYS[1], '*', 'j', ARGV[4])
return 1
