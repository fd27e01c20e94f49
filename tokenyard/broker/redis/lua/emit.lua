-- Append events to jobs' streams, fenced: only the lease holder may speak for a job. Each
-- lease is checked once per call, however many of its events the batch carries.
-- KEYS: none; per item: lane, events
-- ARGV: group; per item: consumer, entry_id, event
-- Returns one flag per item: 1 appended, 0 fenced off.
local held, appended = {}, {}
for i = 1, N do
  local k, a = item(i)
  local lease = k.lane .. ' ' .. a.entry_id .. ' ' .. a.consumer
  local ours = held[lease]
  if ours == nil then
    local p = redis.call('XPENDING', k.lane, A.group, a.entry_id, a.entry_id, 1)
    ours = #p > 0 and p[1][2] == a.consumer
    held[lease] = ours
  end
  if ours then
    redis.call('XADD', k.events, '*', 'e', a.event)
    appended[i] = 1
  else
    appended[i] = 0
  end
end
return appended
