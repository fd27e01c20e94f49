-- Cancel: a waiting job ends now; a running one is flagged for its worker's next step.
-- KEYS: job, events, cancels, delayed
-- ARGV: job_id, now, cancelled_result, cancelled_event, ttl_ms
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'not_found' end
if status == 'running' then
  redis.call('HSET', KEYS[1], 'cancel', '1')
  redis.call('SADD', KEYS[3], ARGV[1])
  return 'signalled'
end
if status ~= 'queued' then return 'already_finished' end
-- its lane entry, if any, is dropped when a worker reads it
redis.call('ZREM', KEYS[4], ARGV[1])
redis.call('HSET', KEYS[1], 'status', 'cancelled', 'cancel', '1', 'result', ARGV[3],
  'end_at', ARGV[2])
redis.call('XADD', KEYS[2], '*', 'e', ARGV[4])
redis.call('PEXPIRE', KEYS[1], ARGV[5])
redis.call('PEXPIRE', KEYS[2], ARGV[5])
return 'cancelled'
