-- Prefix affinity's ownership rule (broker/policy.py), shared by the Redis backend's claim.lua
-- and RabbitMQ lanes' take.lua: a worker that claimed a job with prefix key `pk` (the owner
-- key) owns the prefix for ttl_ms, unless another live worker (its heartbeat in `workers` not
-- lapsed by `now`) owns it: sticky, so a job taken from a busy owner after the wait does not
-- move the prefix off the worker whose cache holds it, and it moves at once when the owner is
-- gone.
local function own_prefix(pk, consumer, workers, now, ttl_ms)
  local owner = redis.call('GET', pk)
  if (not owner) or owner == consumer
    or tonumber(redis.call('ZSCORE', workers, owner) or '0') <= now then
    redis.call('SET', pk, consumer, 'PX', ttl_ms)
  end
end
