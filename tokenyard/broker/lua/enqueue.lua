-- Admit one job atomically: idempotency key, record, lane entry.
-- KEYS: lane, job, idempotency key (or the job key when there is none)
-- ARGV: group, job_id, spec, now, deadline ('' for none), max_depth, idem_ttl_ms, use_idem
-- Returns {1, job_id} created, {0, existing_id} duplicate, {-1, depth} lane full.
local lane, job, idem = KEYS[1], KEYS[2], KEYS[3]
if ARGV[8] == '1' then
  local existing = redis.call('GET', idem)
  if existing then return {0, existing} end
end
if redis.call('EXISTS', lane) == 0 then
  redis.call('XGROUP', 'CREATE', lane, ARGV[1], '0', 'MKSTREAM')
end
local depth = redis.call('XLEN', lane)
if depth >= tonumber(ARGV[6]) then return {-1, depth} end
redis.call('HSET', job, 'spec', ARGV[3], 'status', 'queued', 'lane', lane, 'deliveries', 0,
  'enq_at', ARGV[4], 'deadline', ARGV[5])
redis.call('XADD', lane, '*', 'j', ARGV[2])
if ARGV[8] == '1' then
  redis.call('SET', idem, ARGV[2], 'PX', ARGV[7])
end
return {1, ARGV[2]}
