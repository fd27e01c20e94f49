-- Whether a job of the batch is known already: its idempotency key's job, itself (a resent
-- enqueue whose first attempt landed), or, with a collapse key, an identical job still queued
-- or running, or one that succeeded less than collapse_grace_s ago, which it joins (the rule
-- is broker/policy.py `joinable`, which NATS applies). Returns (that job's id, joined 1|0), or
-- (nil, 0) for a new job, noted in the taken_* tables so the batch's later duplicates find it.
local function admitted(k, a, taken_ids, taken_keys, taken_inflight)
  local use_idem = a.use_idem == '1'
  local existing = nil
  if use_idem then existing = taken_keys[k.idem] or redis.call('GET', k.idem) end
  if not existing and (taken_ids[a.job_id] or redis.call('EXISTS', k.job) == 1) then
    existing = a.job_id
  end
  if not existing and a.use_inflight == '1' then
    -- a key whose job has otherwise ended (or is gone) is ignored, and overwritten by the
    -- new job
    local jid = taken_inflight[k.inflight]
    if not jid then
      jid = redis.call('GET', k.inflight)
      if jid then
        local h = redis.call('HMGET', A.job_prefix .. jid, 'status', 'end_at')
        local status = h[1]
        if status ~= 'queued' and status ~= 'running' and not (status == 'succeeded'
            and tonumber(A.now) - tonumber(h[2] or '0') < tonumber(A.collapse_grace_s)) then
          jid = nil
        end
      end
    end
    if jid then return jid, 1 end
  end
  if existing then return existing, 0 end
  taken_ids[a.job_id] = true
  if use_idem then taken_keys[k.idem] = a.job_id end
  if a.use_inflight == '1' then taken_inflight[k.inflight] = a.job_id end
  return nil, 0
end

-- A new job's keys name it from now on: its idempotency key, its collapse key (in flight).
local function keyed(k, a)
  if a.use_idem == '1' then redis.call('SET', k.idem, a.job_id, 'PX', A.idem_ttl_ms) end
  if a.use_inflight == '1' then redis.call('SET', k.inflight, a.job_id, 'PX', A.idem_ttl_ms) end
end

-- The jobs a batch joined gain their new followers, counted only once the batch is admitted:
-- a batch refused for a full lane joins nothing.
local function join_all(joins)
  for jid, count in pairs(joins) do
    redis.call('HINCRBY', A.job_prefix .. jid, 'followers', count)
  end
end
