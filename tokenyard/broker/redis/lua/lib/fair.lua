-- Fair share inside a lane (a library prepended to enqueue.lua and claim.lua).
-- Jobs wait staged in per-tenant sorted sets (<lane>:tq:<tenant>, earliest deadline first,
-- then arrival); only a small window of them sits in the lane stream itself, where workers'
-- claims and blocking reads see it. Refilling the window takes, each time, the job of the
-- active tenant with the smallest start tag (start-time fair queueing): a job of cost c
-- advances its tenant's tag by c / weight, and a tenant that becomes active starts at the
-- lane's virtual time, so one tenant's backlog delays another's job by at most the window
-- plus one job. Cost and order come from tokenyard/broker/policy.py (fair_cost, staging_score).
-- <lane>:fair hash: stream (staged jobs moved into the stream and not yet read), staged, seq,
-- v (virtual time), S:<tenant> (tag of a tenant with nothing staged), w:<tenant> (weight);
-- held: the lane's jobs held for a preferred worker (prefix affinity; enqueue.lua, claim.lua).
-- <lane>:active zset: tenants with staged jobs, by start tag.
-- A staged member is '<12-digit arrival>:<cost>:<job id>'.

local function fair_num(x) return string.format('%.17g', x) end

-- Top the lane's stream up to `want` staged jobs. `in_stream` is the hash's `stream` count when
-- the caller already read it (nil: read here). Returns the jobs moved and the new count (stored
-- in the hash when any moved).
local function fair_refill(lane, fair, active, tq_prefix, want, in_stream)
  in_stream = in_stream or tonumber(redis.call('HGET', fair, 'stream') or '0')
  if in_stream >= want then return 0, in_stream end
  local moved, v = 0, nil
  while in_stream < want do
    local head = redis.call('ZRANGE', active, 0, 1, 'WITHSCORES')
    if #head == 0 then break end
    local tenant, tag = head[1], tonumber(head[2])
    local rival, rival_tag = head[3], tonumber(head[4] or 'inf')
    local weight = tonumber(redis.call('HGET', fair, 'w:' .. tenant) or '1') or 1
    local tq = tq_prefix .. tenant
    local empty = false
    -- this tenant keeps the turn while its tag stays below the next tenant's
    while in_stream < want and (tag < rival_tag or (tag == rival_tag and tenant < rival)) do
      local popped = redis.call('ZPOPMIN', tq)
      if #popped == 0 then empty = true; break end
      local cost, jid = string.match(popped[1], '^%d+:(%d+):(.+)$')
      redis.call('XADD', lane, '*', 'j', jid)
      v = tag
      tag = tag + tonumber(cost) / weight
      in_stream, moved = in_stream + 1, moved + 1
    end
    if empty or redis.call('EXISTS', tq) == 0 then
      redis.call('ZREM', active, tenant)
      redis.call('HSET', fair, 'S:' .. tenant, fair_num(tag))
    else
      redis.call('ZADD', active, fair_num(tag), tenant)
    end
  end
  if moved > 0 then
    redis.call('HSET', fair, 'stream', in_stream, 'v', fair_num(v))
    redis.call('HINCRBY', fair, 'staged', -moved)
  end
  return moved, in_stream
end

-- The fast path of one new job whose lane has nothing staged and room in its stream: straight
-- into the stream, leaving the tags as staging then refilling it would (the tenant becomes
-- active at max(its idle tag, v), runs at once, and goes idle again one job later), in one
-- HSET instead of ~15 commands. `f` = {stream, v, S:<tenant>} as read from the hash.
-- job = {tenant, weight, score, cost, job_id}, as fair_stage takes it.
local function fair_direct(lane, fair, f, job)
  local start = math.max(tonumber(f[2] or '0') or 0, tonumber(f[3] or '0') or 0)
  local weight = tonumber(job[2]) or 1
  redis.call('XADD', lane, '*', 'j', job[5])
  redis.call('HSET', fair, 'stream', (tonumber(f[1] or '0') or 0) + 1, 'v', fair_num(start),
    'S:' .. job[1], fair_num(start + tonumber(job[4]) / weight), 'w:' .. job[1], job[2])
end

-- Stage a batch of one lane's new jobs: jobs = {{tenant, weight, score, cost, job_id}, ...}.
local function fair_stage(fair, active, tq_prefix, jobs)
  local seq = redis.call('HINCRBY', fair, 'seq', #jobs) - #jobs
  redis.call('HINCRBY', fair, 'staged', #jobs)
  local seen, v = {}, nil
  for _, job in ipairs(jobs) do
    local tenant = job[1]
    seq = seq + 1
    redis.call('ZADD', tq_prefix .. tenant, job[3],
      string.format('%012d', seq) .. ':' .. job[4] .. ':' .. job[5])
    if not seen[tenant] then
      seen[tenant] = true
      redis.call('HSET', fair, 'w:' .. tenant, job[2])
      if not redis.call('ZSCORE', active, tenant) then
        if v == nil then v = tonumber(redis.call('HGET', fair, 'v') or '0') or 0 end
        local idle = tonumber(redis.call('HGET', fair, 'S:' .. tenant) or '0') or 0
        redis.call('ZADD', active, fair_num(math.max(idle, v)), tenant)
      end
    end
  end
end
