-- Admit a batch of one model's jobs atomically: all of them, or none if a lane would overflow.
-- A job whose idempotency key or id is already known is not added again; its id is returned.
-- KEYS: none; per item: lane, job, idem, fair, active
-- ARGV: now, max_depth, idem_ttl_ms, window; per item: job_id, spec, deadline,
--   use_idem, tq_prefix, tenant, weight, cost, score
-- Returns {1, {{created 1|0, job_id}, ...}} or {-1, {item, depth}} when that item's lane is
-- full. A lane's consumer group is made by the first claim that reads it, not here.
-- A new job is staged for its tenant (fair share, lib/fair.lua); the lane's stream is then
-- topped up to `window` jobs, so an idle lane's blocked workers wake at once.
local results, fresh, adding, first_item, taken_ids, taken_keys = {}, {}, {}, {}, {}, {}
for i = 1, N do
  local k, a = item(i)
  local use_idem = a.use_idem == '1'
  local existing = nil
  if use_idem then existing = taken_keys[k.idem] or redis.call('GET', k.idem) end
  if not existing and (taken_ids[a.job_id] or redis.call('EXISTS', k.job) == 1) then
    existing = a.job_id  -- a resent enqueue whose first attempt did land
  end
  if existing then
    results[i] = {0, existing}
  else
    results[i] = {1, a.job_id}
    fresh[#fresh + 1] = i
    adding[k.lane] = (adding[k.lane] or 0) + 1
    first_item[k.lane] = first_item[k.lane] or i
    taken_ids[a.job_id] = true
    if use_idem then taken_keys[k.idem] = a.job_id end
  end
end
local max_depth = tonumber(A.max_depth)
for lane, count in pairs(adding) do
  local k = item(first_item[lane])
  local depth = redis.call('XLEN', lane) + tonumber(redis.call('HGET', k.fair, 'staged') or '0')
  if depth + count > max_depth then return {-1, {first_item[lane], depth}} end
end
local staging, lanes = {}, {}
for _, i in ipairs(fresh) do
  local k, a = item(i)
  redis.call('HSET', k.job, 'spec', a.spec, 'status', 'queued', 'lane', k.lane,
    'deliveries', 0, 'enq_at', A.now, 'deadline', a.deadline)
  if not staging[k.lane] then staging[k.lane] = {}; lanes[#lanes + 1] = i end
  local jobs = staging[k.lane]
  jobs[#jobs + 1] = {a.tenant, a.weight, a.score, a.cost, a.job_id}
  if a.use_idem == '1' then redis.call('SET', k.idem, a.job_id, 'PX', A.idem_ttl_ms) end
end
for _, i in ipairs(lanes) do
  local k, a = item(i)
  fair_stage(k.fair, k.active, a.tq_prefix, staging[k.lane])
  fair_refill(k.lane, k.fair, k.active, a.tq_prefix, tonumber(A.window))
end
return {1, results}
