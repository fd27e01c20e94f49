-- Store one response cache entry with a TTL, keeping the model's entries under max_bytes:
-- entries whose TTL ran out leave the index first, then the soonest to expire are evicted.
-- KEYS: entry, by_expiry, sizes, counters
-- ARGV: digest, value, ttl_ms, now_ms, max_bytes, entry_prefix
-- Returns {total bytes, entries evicted}; an entry larger than max_bytes is not stored.
local size, max_bytes = #A.value, tonumber(A.max_bytes)
if size > max_bytes then return {-1, 0} end
local function forget(digest)
  local old = redis.call('HGET', K.sizes, digest)
  if old then
    redis.call('HDEL', K.sizes, digest)
    redis.call('HINCRBY', K.counters, 'cache_bytes', -tonumber(old))
  end
  redis.call('ZREM', K.by_expiry, digest)
end
local lapsed = redis.call('ZRANGEBYSCORE', K.by_expiry, '-inf', A.now_ms, 'LIMIT', 0, 256)
for _, digest in ipairs(lapsed) do forget(digest) end
forget(A.digest)
redis.call('SET', K.entry, A.value, 'PX', A.ttl_ms)
redis.call('ZADD', K.by_expiry, tonumber(A.now_ms) + tonumber(A.ttl_ms), A.digest)
redis.call('HSET', K.sizes, A.digest, size)
local total = redis.call('HINCRBY', K.counters, 'cache_bytes', size)
local evicted = 0
while total > max_bytes do
  local first = redis.call('ZRANGE', K.by_expiry, 0, 0)
  if not first[1] then break end
  redis.call('DEL', A.entry_prefix .. first[1])
  forget(first[1])
  total = tonumber(redis.call('HGET', K.counters, 'cache_bytes') or '0')
  evicted = evicted + 1
end
return {total, evicted}
