-- Fenced completion of a batch: each entry must still be its consumer's; the first terminal
-- record wins; then one XDEL per lane for the whole batch.
-- The fence: the job's record names this consumer as its worker (claim.lua sets it on each
-- delivery), and the entry's XACK acks it, i.e. it was still pending. A pending entry is always
-- its reader's (reap.lua acks and deletes what its XAUTOCLAIM takes in the same call, renew.lua's
-- XCLAIM keeps the owner), so a lease lost to the reaper, completed already, or another
-- consumer's is fenced off, as XPENDING would, in one command instead of XPENDING and an XACK.
-- KEYS: cancels, counters; per item: lane, job, events
-- ARGV: group, now, ttl_ms; per item: consumer, entry_id, job_id, status, finished, tail
-- `finished` is the Finished event; it is also stored as the record's result, so the result
-- crosses the wire once. `tail` is the last token chunk, or ''.
-- Returns one flag per item: 1 accepted, 0 fenced off (the lease was lost).
local accepted, by_lane = {}, {}
for i = 1, N do
  local k, a = item(i)
  local h = redis.call('HMGET', k.job, 'status', 'cancel', 'worker')
  -- (a record that is gone names nobody: the entry alone decides)
  if (h[3] and h[3] ~= a.consumer) or redis.call('XACK', k.lane, A.group, a.entry_id) == 0 then
    redis.call('HINCRBY', K.counters, 'fenced', 1)
    accepted[i] = 0
  else
    -- a cancel request is in the model's `cancels` set only where the record carries it
    -- (cancel.lua flags both at once): an SREM for every other job would be a command for nothing
    local cancels = h[2] == '1' and K.cancels or nil
    if h[1] == 'queued' or h[1] == 'running' then
      finish(k.job, k.events, cancels, a.job_id, a.status, a.finished, A.now, A.ttl_ms, a.tail)
    elseif cancels then
      redis.call('SREM', cancels, a.job_id)
    end
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
    redis.call('XDEL', lane, unpack(ids, first, math.min(first + 999, #ids)))
  end
end
return accepted
