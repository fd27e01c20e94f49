-- Fair share inside a lane (a library prepended to enqueue.lua and claim.lua).
-- Jobs wait staged in per-tenant sorted sets (<lane>:tq:<tenant>, earliest deadline first);
-- only a small window of them sits in the lane stream itself, where workers' claims and
-- blocking reads see it. Refilling the window picks, each time, the active tenant with the
-- smallest start tag (start-time fair queueing): a job of cost c advances its tenant's tag by
-- c / weight, and a tenant that becomes active starts at the lane's virtual time, so a long
-- backlog of one tenant delays another's job by at most the window plus one job.
-- <lane>:fair hash: stream (staged jobs moved into the stream and not yet read), staged,
-- v (virtual time), S:<tenant> (tag of an idle tenant), w:<tenant> (weight).
-- <lane>:active zset: tenants with staged jobs, by start tag.
local function fair_refill(lane, fair, active, tq_prefix, job_prefix, want)
  local in_stream = tonumber(redis.call('HGET', fair, 'stream') or '0')
  local moved = 0
  while in_stream < want do
    local head = redis.call('ZRANGE', active, 0, 0, 'WITHSCORES')
    if #head == 0 then break end
    local tenant, tag = head[1], tonumber(head[2])
    local tq = tq_prefix .. tenant
    local popped = redis.call('ZPOPMIN', tq)
    if #popped == 0 then
      redis.call('ZREM', active, tenant)
    else
      local jid = string.sub(popped[1], 14)  -- after the arrival number and ':'
      local cost = tonumber(redis.call('HGET', job_prefix .. jid, 'cost') or '1') or 1
      local weight = tonumber(redis.call('HGET', fair, 'w:' .. tenant) or '1') or 1
      local next_tag = tag + cost / weight
      redis.call('HSET', fair, 'v', string.format('%.17g', tag))
      if redis.call('EXISTS', tq) == 1 then
        redis.call('ZADD', active, string.format('%.17g', next_tag), tenant)
      else
        redis.call('ZREM', active, tenant)
        redis.call('HSET', fair, 'S:' .. tenant, string.format('%.17g', next_tag))
      end
      redis.call('XADD', lane, '*', 'j', jid)
      in_stream, moved = in_stream + 1, moved + 1
    end
  end
  if moved > 0 then
    redis.call('HSET', fair, 'stream', in_stream)
    redis.call('HINCRBY', fair, 'staged', -moved)
  end
  return moved
end

-- Stage one job for its tenant; its score orders the tenant's own jobs (deadline first), and
-- equal scores keep arrival order: the member leads with a 12-digit arrival number.
local function fair_stage(fair, active, tq_prefix, tenant, weight, score, jid)
  local seq = redis.call('HINCRBY', fair, 'seq', 1)
  redis.call('ZADD', tq_prefix .. tenant, score, string.format('%012d', seq) .. ':' .. jid)
  redis.call('HSET', fair, 'w:' .. tenant, weight)
  redis.call('HINCRBY', fair, 'staged', 1)
  if not redis.call('ZSCORE', active, tenant) then
    local idle = tonumber(redis.call('HGET', fair, 'S:' .. tenant) or '0') or 0
    local v = tonumber(redis.call('HGET', fair, 'v') or '0') or 0
    redis.call('ZADD', active, string.format('%.17g', math.max(idle, v)), tenant)
  end
end

-- The stream was read: `n` fewer staged jobs wait in it (a retry added directly is not counted,
-- so the count never goes below zero).
local function fair_read(fair, n)
  if n > 0 then
    local left = tonumber(redis.call('HINCRBY', fair, 'stream', -n))
    if left < 0 then redis.call('HSET', fair, 'stream', 0) end
  end
end
