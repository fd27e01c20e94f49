-- A delivery failed: retry after backoff, or dead-letter when forced or past the limit.
-- KEYS: lane, job, events, cancels, counters, delayed, dlq
-- ARGV: group, consumer, entry_id, job_id, error, now, due_at, max_deliveries, dead_result,
--       dead_event, ttl_ms, reason, force_dead ('1'/'0')
-- Returns 1 retrying, 0 dead-lettered, -1 fenced off.
local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[3], ARGV[3], 1)
if #p == 0 or p[1][2] ~= ARGV[2] then
  redis.call('HINCRBY', KEYS[5], 'fenced', 1)
  return -1
end
redis.call('XACK', KEYS[1], ARGV[1], ARGV[3])
redis.call('XDEL', KEYS[1], ARGV[3])
local deliveries = tonumber(redis.call('HGET', KEYS[2], 'deliveries') or '0')
if ARGV[13] ~= '1' and deliveries < tonumber(ARGV[8]) then
  redis.call('HSET', KEYS[2], 'status', 'queued', 'last_error', ARGV[5])
  redis.call('ZADD', KEYS[6], ARGV[7], ARGV[4])
  return 1
end
redis.call('HSET', KEYS[2], 'status', 'dead', 'result', ARGV[9], 'last_error', ARGV[5],
  'end_at', ARGV[6])
redis.call('XADD', KEYS[7], '*', 'job', ARGV[4], 'lane', KEYS[1], 'reason', ARGV[12],
  'error', ARGV[5], 'deliveries', deliveries, 'at', ARGV[6])
redis.call('XADD', KEYS[3], '*', 'e', ARGV[10])
redis.call('PEXPIRE', KEYS[2], ARGV[11])
redis.call('PEXPIRE', KEYS[3], ARGV[11])
redis.call('SREM', KEYS[4], ARGV[4])
redis.call('HINCRBY', KEYS[5], 'dead', 1)
return 0
