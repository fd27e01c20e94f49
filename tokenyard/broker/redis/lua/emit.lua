-- Append events to jobs' streams, fenced: only the lease holder (its pending entry's consumer)
-- may speak for a job (lib/events.lua).
-- KEYS: none; per item: lane, events
-- ARGV: group; per item: consumer, entry_id, event
-- Returns one flag per item: 1 appended, 0 fenced off.
return append_held(
  function(k, a) return k.lane .. ' ' .. a.entry_id .. ' ' .. a.consumer end,
  function(k, a)
    local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
    return #p > 0 and p[1][2] == a.consumer
  end)
