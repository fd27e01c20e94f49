-- Admit a batch of one model's jobs for RabbitMQ lanes: a record per new job, idempotency keys
-- and collapsing as enqueue.lua, and the lane bound (its waiting set; RabbitMQ's own length
-- bound overshoots under concurrent publishes). All of the batch, or none if a lane would
-- overflow. The caller then publishes each new job's message, whose id the record names
-- (`msg`): a message the record does not name is stale (take.lua drops it); once RabbitMQ
-- confirmed it, the caller marks the record published (`pub`). A resend that finds its job
-- still queued and unpublished (its producer may have died between the record and the
-- message) names the resend's message instead, for the caller to publish: however soon it
-- comes, as it may be the only resend (a batch's runner taking over resends each line once).
-- Had the first producer lived, its message is stale: one message more, dropped at its claim.
-- A job published after its record (`late`) waits in its lane's `unpub` set until the caller
-- marks it: one whose producer died first and that no resend finishes is published by the
-- reaper (unpublished.lua).
-- KEYS: none; per item: job, idem, inflight, waiting, unpub
-- ARGV: now, idem_ttl_ms, job_prefix, max_depth, collapse_grace_s; per item:
--   job_id, spec, deadline, use_idem, use_inflight, msg, lane, prefix, pref, affw, late
-- Prefix affinity: a job's prefix key is kept (`pfx`: take.lua makes its taker the owner); a
-- job the caller holds for a worker (`pref`, affinity.py) is in that worker's held set `affw`
-- by when it was held, and counts as waiting like any other.
-- Returns {1, {{created 1|0, job_id, joined 1|0, publish 1|0}, ...}}, or {-1, {item, depth}}
-- when that item's lane is full.
local results, fresh, adding, first_item = {}, {}, {}, {}
local taken_ids, taken_keys, taken_inflight, joins = {}, {}, {}, {}
for i = 1, N do
  local k, a = item(i)
  local existing, joined = admitted(k, a, taken_ids, taken_keys, taken_inflight)
  if existing then
    local again = 0
    if joined == 1 then
      joins[existing] = (joins[existing] or 0) + 1
    else
      local jk = A.job_prefix .. existing
      local h = redis.call('HMGET', jk, 'status', 'pub')
      if h[1] == 'queued' and h[2] == '0' then
        redis.call('HSET', jk, 'msg', a.msg)
        again = 1
      end
    end
    results[i] = {0, existing, joined, again}
  else
    results[i] = {1, a.job_id, 0, 1}
    fresh[#fresh + 1] = i
    adding[k.waiting] = (adding[k.waiting] or 0) + 1
    first_item[k.waiting] = first_item[k.waiting] or i
  end
end
for waiting, count in pairs(adding) do
  local depth = redis.call('ZCARD', waiting)
  if depth + count > tonumber(A.max_depth) then return {-1, {first_item[waiting], depth}} end
end
for _, i in ipairs(fresh) do
  local k, a = item(i)
  local fields = {'spec', a.spec, 'status', 'queued', 'lane', a.lane, 'deliveries', 0,
    'enq_at', A.now, 'deadline', a.deadline, 'msg', a.msg, 'pub', 0}
  if a.use_inflight == '1' then fields[#fields + 1], fields[#fields + 2] = 'followers', 1 end
  if a.prefix ~= '' then fields[#fields + 1], fields[#fields + 2] = 'pfx', a.prefix end
  if a.pref ~= '' then
    fields[#fields + 1], fields[#fields + 2] = 'pref', a.pref
    redis.call('ZADD', a.affw, A.now, a.job_id)
  end
  redis.call('HSET', k.job, unpack(fields))
  redis.call('ZADD', k.waiting, A.now, a.job_id)
  if a.late == '1' then redis.call('ZADD', k.unpub, A.now, a.job_id) end
  keyed(k, a)
end
join_all(joins)
return {1, results}
