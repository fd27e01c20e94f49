-- Fenced completion of a batch: each entry must still be its consumer's; the first terminal
-- record wins; then XACK + XDEL.
-- KEYS: per item: lane, job, events; then cancels, counters
-- ARGV: group, now, ttl_ms, n, then per item: consumer, entry_id, job_id, status, result,
--       event, tail (the last token chunk, or '')
-- Returns one flag per item: 1 accepted, 0 fenced off (the lease was lost).
local group, now, ttl, n = ARGV[1], ARGV[2], ARGV[3], tonumber(ARGV[4])
local cancels, counters = KEYS[3 * n + 1], KEYS[3 * n + 2]
local accepted = {}
for i = 1, n do
  local lane, job, events = KEYS[3 * i - 2], KEYS[3 * i - 1], KEYS[3 * i]
  local a = 4 + (i - 1) * 7
  local consumer, entry_id = ARGV[a + 1], ARGV[a + 2]
  local p = redis.call('XPENDING', lane, group, entry_id, entry_id, 1)
  if #p == 0 or p[1][2] ~= consumer then
    redis.call('HINCRBY', counters, 'fenced', 1)
    accepted[i] = 0
  else
    local h = redis.call('HMGET', job, 'status', 'cancel')
    local status = h[1]
    if status == 'queued' or status == 'running' then
      redis.call('HSET', job, 'status', ARGV[a + 4], 'result', ARGV[a + 5], 'end_at', now)
      if ARGV[a + 7] ~= '' then redis.call('XADD', events, '*', 'e', ARGV[a + 7]) end
      redis.call('XADD', events, '*', 'e', ARGV[a + 6])
      redis.call('PEXPIRE', job, ttl)
      redis.call('PEXPIRE', events, ttl)
    end
    redis.call('XACK', lane, group, entry_id)
    redis.call('XDEL', lane, entry_id)
    if h[2] == '1' then redis.call('SREM', cancels, ARGV[a + 3]) end
    accepted[i] = 1
  end
end
return accepted
