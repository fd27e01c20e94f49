-- Take delivered messages as leases. A message is its job's only while the record names it
-- (`msg`): one the record does not name, or whose job ended, is stale and dropped. A job past
-- its deadline expires; one whose holders all lost it `max_deliveries` times is dead; the rest
-- run under a fresh lease token, the lease's deadline in the lane's lease set (reap.lua).
-- KEYS: dlq, counters, cancels, delayed, workers; per item: job, events, waiting, leases
-- ARGV: now, consumer, lease_s, max_deliveries, ttl_ms, expired_event, dead_event, dead_error,
--   cancelled, pfx_prefix, pfx_ttl_ms; per item: job_id, msg, token, priority, affw_prefix
-- Prefix affinity: a job held for a worker (`pref`) leaves its held set when anyone takes it
-- (from the held queue, or from the lane once it waited the bound); a leased job with a prefix
-- key makes this worker its owner, unless another live worker owns it (lib/affinity.lua).
-- A job redelivered after its holder's connection died ends cancelled if a client asked to
-- cancel it meanwhile (`cancelled`: Finished(cancelled result)).
-- A message with no record yet (no `status`) and no tombstone (`<job>:gone`: an enqueue that
-- published it was refused or withdrawn) came before its record: a job no key names is
-- published while its admit.lua runs (queue.py `enqueue_many`), so the caller holds it and
-- asks again.
-- Returns per item {code, spec, attempt, resumable, preemptions}: code 1 leased, 0 stale,
-- 2 expired, 3 dead, 4 cancelled, 5 no record yet.
local now = tonumber(A.now)
local out = {}
for i = 1, N do
  local k, a = item(i)
  local h = redis.call('HMGET', k.job, 'status', 'spec', 'msg', 'deadline', 'deliveries',
    'start_at', 'cancel', 'pref', 'pfx', 'preempted')
  if not h[1] and redis.call('EXISTS', k.job .. ':gone') == 0 then
    out[i] = {5, '', 0, 0, 0}
  elseif (h[1] ~= 'queued' and h[1] ~= 'running') or h[3] ~= a.msg then
    -- a held job that ended while it waited (cancelled): its owner need not look for it
    if h[1] and h[8] and h[1] ~= 'queued' and h[1] ~= 'running' then
      redis.call('ZREM', a.affw_prefix .. h[8], a.job_id)
    end
    out[i] = {0, '', 0, 0, 0}
  else
    redis.call('ZREM', k.waiting, a.job_id)
    redis.call('ZREM', K.delayed, a.job_id)
    if h[8] then
      redis.call('ZREM', a.affw_prefix .. h[8], a.job_id)
      redis.call('HDEL', k.job, 'pref')
    end
    local deliveries = tonumber(h[5] or '0')
    if h[1] == 'queued' and h[4] and h[4] ~= '' and tonumber(h[4]) < now then
      finish(k.job, k.events, nil, a.job_id, 'expired', A.expired_event, A.now, A.ttl_ms, '')
      redis.call('HINCRBY', K.counters, 'expired', 1)
      out[i] = {2, h[2], 0, 0, 0}
    elseif h[7] == '1' then
      redis.call('ZREM', k.leases, a.job_id)
      redis.call('HSET', k.job, 'lease', '')
      finish(k.job, k.events, K.cancels, a.job_id, 'cancelled', A.cancelled, A.now, A.ttl_ms, '')
      out[i] = {4, h[2], 0, 0, 0}
    elseif deliveries >= tonumber(A.max_deliveries) then
      -- redelivered after each holder's connection died (RabbitMQ requeued it)
      redis.call('ZREM', k.leases, a.job_id)
      redis.call('HSET', k.job, 'last_error', A.dead_error, 'lease', '')
      finish(k.job, k.events, K.cancels, a.job_id, 'dead', A.dead_event, A.now, A.ttl_ms, '')
      bury(K.dlq, K.counters, a.job_id, a.priority, 'lease_expired', A.dead_error, deliveries,
        A.now)
      out[i] = {3, h[2], 0, 0, 0}
    else
      redis.call('HSET', k.job, 'status', 'running', 'start_at', A.now, 'worker', A.consumer,
        'deliveries', deliveries + 1, 'lease', a.token)
      redis.call('ZADD', k.leases, now + tonumber(A.lease_s), a.job_id)
      if h[9] and h[9] ~= '' then
        own_prefix(A.pfx_prefix .. h[9], A.consumer, K.workers, now, A.pfx_ttl_ms)
      end
      -- only a job started before can have streamed events (only a lease holder appends)
      local resumable = 0
      if h[6] then resumable = redis.call('EXISTS', k.events) end
      out[i] = {1, h[2], deliveries, resumable, tonumber(h[10] or '0')}
    end
  end
end
return out
