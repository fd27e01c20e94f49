-- Fenced completion: the entry must still be ours; the first terminal record wins.
-- KEYS: lane, job, events, cancels, counters
-- ARGV: group, consumer, entry_id, job_id, status, result, event, now, ttl_ms
-- Returns 1 accepted, 0 fenced off (the lease was lost).
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  redis.call('HINCRBY', KEYS[5], 'fenced', 1)
  return 0
end
local status = redis.call('HGET', KEYS[2], 'status')
if status == 'queued' or status == 'running' then
  redis.call('HSET', KEYS[2], 'status', ARGV[5], 'result', ARGV[6], 'end_at', ARGV[8])
  redis.call('XADD', KEYS[3], '*', 'e', ARGV[7])
  redis.call('PEXPIRE', KEYS[2], ARGV[9])
  redis.call('PEXPIRE', KEYS[3], ARGV[9])
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
redis.call('SREM', KEYS[4], ARGV[4])
return 1
