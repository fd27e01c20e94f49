-- Admit a batch of one model's jobs atomically: all of them, or none if a lane would overflow.
-- A job whose idempotency key or id is already known is not added again; its id is returned.
-- KEYS: lane_1 .. lane_L, then per job: job record, idempotency key (or the job key again)
-- ARGV: group, now, max_depth, idem_ttl_ms, n_jobs, n_lanes,
--       then per job: lane_index, job_id, spec, deadline ('' for none), use_idem ('1'/'0')
-- Returns {1, {{created 1|0, job_id}, ...}} or {-1, {lane_index, depth}} when a lane is full.
local group, now, max_depth, idem_ttl = ARGV[1], ARGV[2], tonumber(ARGV[3]), ARGV[4]
local n, n_lanes = tonumber(ARGV[5]), tonumber(ARGV[6])
local results, fresh, adding, claimed_ids, claimed_keys = {}, {}, {}, {}, {}
for i = 1, n do
  local a = 6 + (i - 1) * 5
  local lane_index, job_id, use_idem = tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 5] == '1'
  local job, idem = KEYS[n_lanes + 2 * i - 1], KEYS[n_lanes + 2 * i]
  local existing = nil
  if use_idem then existing = claimed_keys[idem] or redis.call('GET', idem) end
  if not existing and (claimed_ids[job_id] or redis.call('EXISTS', job) == 1) then
    existing = job_id  -- a resent enqueue whose first attempt did land
  end
  if existing then
    results[i] = {0, existing}
  else
    results[i] = {1, job_id}
    fresh[#fresh + 1] = i
    adding[lane_index] = (adding[lane_index] or 0) + 1
    claimed_ids[job_id] = true
    if use_idem then claimed_keys[idem] = job_id end
  end
end
for lane_index, count in pairs(adding) do
  local lane = KEYS[lane_index]
  if redis.call('EXISTS', lane) == 0 then
    redis.call('XGROUP', 'CREATE', lane, group, '0', 'MKSTREAM')
  end
  local depth = redis.call('XLEN', lane)
  if depth + count > max_depth then return {-1, {lane_index, depth}} end
end
for _, i in ipairs(fresh) do
  local a = 6 + (i - 1) * 5
  local lane, job_id = KEYS[tonumber(ARGV[a + 1])], ARGV[a + 2]
  local job, idem = KEYS[n_lanes + 2 * i - 1], KEYS[n_lanes + 2 * i]
  redis.call('HSET', job, 'spec', ARGV[a + 3], 'status', 'queued', 'lane', lane,
    'deliveries', 0, 'enq_at', now, 'deadline', ARGV[a + 4])
  redis.call('XADD', lane, '*', 'j', job_id)
  if ARGV[a + 5] == '1' then redis.call('SET', idem, job_id, 'PX', idem_ttl) end
end
return {1, results}
