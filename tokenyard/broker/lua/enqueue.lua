-- Admit a batch of one model's jobs atomically: all of them, or none if a lane would overflow.
-- A job whose idempotency key or id is already known is not added again; its id is returned.
-- A job with a collapse key whose job is still queued or running joins that job instead
-- (collapsing): its id is returned and the job counts one more follower.
-- KEYS: workers; per item: lane, job, idem, fair, active, inflight, held
-- ARGV: now, max_depth, idem_ttl_ms, window, job_prefix, pfx_prefix, wake_prefix, max_held;
--   per item: job_id, spec, deadline, use_idem, tq_prefix, tenant, weight, cost, score,
--   use_inflight, prefix, affw_prefix
-- Returns {1, {{created 1|0, job_id, joined 1|0}, ...}} or {-1, {item, depth}} when that
-- item's lane is full. A lane's consumer group is made by the first claim that reads it.
-- A new job is staged for its tenant (fair share, lib/fair.lua); the lane's stream is then
-- topped up to `window` jobs, so an idle lane's blocked workers wake at once.
-- Prefix affinity: a job whose prefix key names a live worker (its heartbeat has not lapsed;
-- see claim.lua for who owns a prefix) is held for it instead (the lane's `held` set and that
-- worker's own set), unless max_held already wait for it; that worker's wake stream is nudged.
-- claim.lua gives it to that worker first, or to any worker once it waited the affinity bound.
local results, fresh, adding, first_item, taken_ids, taken_keys = {}, {}, {}, {}, {}, {}
local taken_inflight, joins = {}, {}
for i = 1, N do
  local k, a = item(i)
  local use_idem = a.use_idem == '1'
  local existing = nil
  local joined = 0
  if use_idem then existing = taken_keys[k.idem] or redis.call('GET', k.idem) end
  if not existing and (taken_ids[a.job_id] or redis.call('EXISTS', k.job) == 1) then
    existing = a.job_id  -- a resent enqueue whose first attempt did land
  end
  if not existing and a.use_inflight == '1' then
    -- collapsing: a key whose job has ended (or is gone) is ignored, and overwritten below
    local jid = taken_inflight[k.inflight]
    if not jid then
      jid = redis.call('GET', k.inflight)
      if jid then
        local status = redis.call('HGET', A.job_prefix .. jid, 'status')
        if status ~= 'queued' and status ~= 'running' then jid = nil end
      end
    end
    if jid then
      existing, joined = jid, 1
      joins[jid] = (joins[jid] or 0) + 1
    end
  end
  if existing then
    results[i] = {0, existing, joined}
  else
    results[i] = {1, a.job_id, 0}
    fresh[#fresh + 1] = i
    adding[k.lane] = (adding[k.lane] or 0) + 1
    first_item[k.lane] = first_item[k.lane] or i
    taken_ids[a.job_id] = true
    if use_idem then taken_keys[k.idem] = a.job_id end
    if a.use_inflight == '1' then taken_inflight[k.inflight] = a.job_id end
  end
end
local max_depth = tonumber(A.max_depth)
for lane, count in pairs(adding) do
  local k = item(first_item[lane])
  local depth = redis.call('XLEN', lane) + tonumber(redis.call('HGET', k.fair, 'staged') or '0')
    + redis.call('ZCARD', k.held)
  if depth + count > max_depth then return {-1, {first_item[lane], depth}} end
end
local staging, lanes = {}, {}
for _, i in ipairs(fresh) do
  local k, a = item(i)
  redis.call('HSET', k.job, 'spec', a.spec, 'status', 'queued', 'lane', k.lane,
    'deliveries', 0, 'enq_at', A.now, 'deadline', a.deadline)
  local owner = false
  if a.prefix ~= '' then
    redis.call('HSET', k.job, 'pfx', a.prefix)
    owner = redis.call('GET', A.pfx_prefix .. a.prefix)
    if owner and tonumber(redis.call('ZSCORE', K.workers, owner) or '0') <= tonumber(A.now) then
      owner = false  -- its worker is gone: nobody to wait for
    end
    if owner and redis.call('ZCARD', a.affw_prefix .. owner) >= tonumber(A.max_held) then
      owner = false  -- a hot prefix must not pile up behind one worker
    end
  end
  if owner then
    redis.call('HSET', k.job, 'pref', owner)
    -- a microsecond per item keeps a batch's held jobs in arrival order (equal scores would sort
    -- by job id)
    local at = string.format('%.6f', tonumber(A.now) + i * 1e-6)
    redis.call('ZADD', k.held, at, a.job_id)
    redis.call('ZADD', a.affw_prefix .. owner, at, a.job_id)
    redis.call('XADD', A.wake_prefix .. owner, 'MAXLEN', 8, '*', 'j', a.job_id)
  else
    if not staging[k.lane] then staging[k.lane] = {}; lanes[#lanes + 1] = i end
    local jobs = staging[k.lane]
    jobs[#jobs + 1] = {a.tenant, a.weight, a.score, a.cost, a.job_id}
  end
  if a.use_idem == '1' then redis.call('SET', k.idem, a.job_id, 'PX', A.idem_ttl_ms) end
  if a.use_inflight == '1' then
    redis.call('SET', k.inflight, a.job_id, 'PX', A.idem_ttl_ms)
    redis.call('HSET', k.job, 'followers', 1)
  end
end
-- counted only now: a batch refused for a full lane joins nothing
for jid, count in pairs(joins) do
  redis.call('HINCRBY', A.job_prefix .. jid, 'followers', count)
end
for _, i in ipairs(lanes) do
  local k, a = item(i)
  fair_stage(k.fair, k.active, a.tq_prefix, staging[k.lane])
  fair_refill(k.lane, k.fair, k.active, a.tq_prefix, tonumber(A.window))
end
return {1, results}
