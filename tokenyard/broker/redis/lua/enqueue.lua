-- Admit a batch of one model's jobs atomically: all of them, or none if a lane would overflow.
-- A job whose idempotency key or id is already known is not added again; its id is returned.
-- A job with a collapse key whose job is still queued or running (or succeeded within
-- collapse_grace_s) joins that job instead (collapsing): its id is returned and the job counts
-- one more follower.
-- KEYS: workers; per item: lane, job, idem, inflight
-- ARGV: now, max_depth, idem_ttl_ms, window, job_prefix, pfx_prefix, wake_prefix, max_held,
--   collapse_grace_s;
--   per item: job_id, spec, deadline, use_idem, use_inflight, tenant, weight, cost, score, prefix
-- A lane's other keys hang off its name as broker/redis/keys.py names them (<lane>:fair,
-- :active, :tq:<tenant>, :affq, :affw:<consumer>; all in the lane's slot), built here rather
-- than sent per item (as in claim.lua: every argument costs the server a parse, an allocation
-- and a Lua string per call, and a batch's repeated names are one interned Lua string).
-- Returns {1, created 1|0, job_id, joined 1|0, ...} (three values per item, flat: each table a
-- script returns costs the server a reply node and a probe of seven special fields) or
-- {-1, item, depth} when that item's lane is full. A lane's consumer group is made by the first claim that reads it.
-- A new job is staged for its tenant (fair share, lib/fair.lua); the lane's stream is then
-- topped up to `window` jobs, so an idle lane's blocked workers wake at once. The lane's only
-- new job when nothing is staged and the stream is below `window` goes straight into the
-- stream with the same tags (fair_direct): the common single-job case costs no staging.
-- Prefix affinity: a job whose prefix key names a live worker (its heartbeat has not lapsed;
-- see claim.lua for who owns a prefix) is held for it instead (the lane's `held` set and that
-- worker's own set), unless max_held already wait for it; that worker's wake stream is nudged.
-- The lane's fair hash counts its held jobs (`held`) for the depth check, so admission reads
-- one hash and the stream's length; claim.lua sets the count from the set whenever it takes some.
-- claim.lua gives it to that worker first, or to any worker once it waited the affinity bound.
-- each item's table once: item() builds one per call
local ks, as = {}, {}
for i = 1, N do ks[i], as[i] = item(i) end
local results, fresh, adding, first_item, taken_ids, taken_keys = {1}, {}, {}, {}, {}, {}
local taken_inflight, joins = {}, {}
for i = 1, N do
  local k, a = ks[i], as[i]
  local existing, joined = admitted(k, a, taken_ids, taken_keys, taken_inflight)
  if existing then
    results[3 * i - 1], results[3 * i], results[3 * i + 1] = 0, existing, joined
    if joined == 1 then joins[existing] = (joins[existing] or 0) + 1 end
  else
    results[3 * i - 1], results[3 * i], results[3 * i + 1] = 1, a.job_id, 0
    fresh[#fresh + 1] = i
    adding[k.lane] = (adding[k.lane] or 0) + 1
    first_item[k.lane] = first_item[k.lane] or i
  end
end
local max_depth, window = tonumber(A.max_depth), tonumber(A.window)
-- lanes whose one new job may take the fast path: their fair state {stream, v, S:<tenant>}
local direct = {}
for lane, count in pairs(adding) do
  local k, a = ks[first_item[lane]], as[first_item[lane]]
  local f = redis.call('HMGET', k.lane .. ':fair', 'staged', 'stream', 'v', 'S:' .. a.tenant, 'held')
  local staged = tonumber(f[1] or '0')
  -- the held jobs' count from the same read, not a ZCARD of the held set: kept below and by
  -- claim.lua, the only scripts that add to or take from that set
  local depth = redis.call('XLEN', lane) + staged + math.max(0, tonumber(f[5] or '0') or 0)
  if depth + count > max_depth then return {-1, first_item[lane], depth} end
  if count == 1 and staged <= 0 and (tonumber(f[2] or '0') or 0) < window then
    direct[lane] = {f[2], f[3], f[4]}
  end
end
local staging, lanes = {}, {}
for _, i in ipairs(fresh) do
  local k, a = ks[i], as[i]
  local fields = {'spec', a.spec, 'status', 'queued', 'lane', k.lane, 'deliveries', 0,
    'enq_at', A.now, 'deadline', a.deadline}
  local owner = false
  if a.prefix ~= '' then
    fields[#fields + 1], fields[#fields + 2] = 'pfx', a.prefix
    owner = redis.call('GET', A.pfx_prefix .. a.prefix)
    if owner and tonumber(redis.call('ZSCORE', K.workers, owner) or '0') <= tonumber(A.now) then
      owner = false  -- its worker is gone: nobody to wait for
    end
    if owner and redis.call('ZCARD', k.lane .. ':affw:' .. owner) >= tonumber(A.max_held) then
      owner = false  -- a hot prefix must not pile up behind one worker
    end
  end
  if owner then fields[#fields + 1], fields[#fields + 2] = 'pref', owner end
  if a.use_inflight == '1' then fields[#fields + 1], fields[#fields + 2] = 'followers', 1 end
  redis.call('HSET', k.job, unpack(fields))
  if owner then
    -- a microsecond per item keeps a batch's held jobs in arrival order (equal scores would sort
    -- by job id); written exactly: '%.6f' of it rounds two neighbours to one value ~5% of the
    -- time (a double near 1.8e9 holds ~0.24 µs)
    local at = string.format('%.17g', tonumber(A.now) + i * 1e-6)
    redis.call('ZADD', k.lane .. ':affq', at, a.job_id)
    redis.call('HINCRBY', k.lane .. ':fair', 'held', 1)
    redis.call('ZADD', k.lane .. ':affw:' .. owner, at, a.job_id)
    redis.call('XADD', A.wake_prefix .. owner, 'MAXLEN', 8, '*', 'j', a.job_id)
  else
    local job = {a.tenant, a.weight, a.score, a.cost, a.job_id}
    if direct[k.lane] then
      fair_direct(k.lane, k.lane .. ':fair', direct[k.lane], job)
    else
      if not staging[k.lane] then staging[k.lane] = {}; lanes[#lanes + 1] = i end
      local jobs = staging[k.lane]
      jobs[#jobs + 1] = job
    end
  end
  keyed(k, a)
end
join_all(joins)
for _, i in ipairs(lanes) do
  local k, a = ks[i], as[i]
  local fair, active, tq_prefix = k.lane .. ':fair', k.lane .. ':active', k.lane .. ':tq:'
  fair_stage(fair, active, tq_prefix, staging[k.lane])
  fair_refill(k.lane, fair, active, tq_prefix, window)
end
return results
