-- Fenced completion of a batch: each entry must still be its consumer's; the first terminal
-- record wins; then one XACK and one XDEL per lane for the whole batch.
-- KEYS: cancels, counters; per item: lane, job, events
-- ARGV: group, now, ttl_ms; per item: consumer, entry_id, job_id, status, finished, tail
-- `finished` is the Finished event; it is also stored as the record's result, so the result
-- crosses the wire once. `tail` is the last token chunk, or ''.
-- Returns one flag per item: 1 accepted, 0 fenced off (the lease was lost).
local accepted, settled, by_lane = {}, {}, {}
for i = 1, N do
  local k, a = item(i)
  local entry = k.lane .. ' ' .. a.entry_id
  local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
  if #p == 0 or p[1][2] ~= a.consumer or settled[entry] then
    redis.call('HINCRBY', K.counters, 'fenced', 1)
    accepted[i] = 0
  else
    settled[entry] = true
    local h = redis.call('HMGET', k.job, 'status', 'cancel')
    if h[1] == 'queued' or h[1] == 'running' then
      redis.call('HSET', k.job, 'status', a.status, 'result', a.finished, 'end_at', A.now)
      if a.tail ~= '' then redis.call('XADD', k.events, '*', 'e', a.tail) end
      redis.call('XADD', k.events, '*', 'e', a.finished)
      redis.call('PEXPIRE', k.job, A.ttl_ms)
      redis.call('PEXPIRE', k.events, A.ttl_ms)
    end
    if h[2] == '1' then redis.call('SREM', K.cancels, a.job_id) end
    local ids = by_lane[k.lane]
    if not ids then
      ids = {}
      by_lane[k.lane] = ids
    end
    ids[#ids + 1] = a.entry_id
    accepted[i] = 1
  end
end
for lane, ids in pairs(by_lane) do
  -- in chunks: unpack() is bounded by the Lua stack
  for first = 1, #ids, 1000 do
    local last = math.min(first + 999, #ids)
    redis.call('XACK', lane, A.group, unpack(ids, first, last))
    redis.call('XDEL', lane, unpack(ids, first, last))
  end
end
return accepted
