-- Append events to jobs' streams, fenced by the lease token: only its holder speaks for a job.
-- KEYS: none; per item: job, events
-- ARGV: none; per item: consumer, token, event
-- Returns one flag per item: 1 appended, 0 fenced off.
local held, appended = {}, {}
for i = 1, N do
  local k, a = item(i)
  local ours = held[a.token]
  if ours == nil then
    ours = holds(k.job, a.consumer, a.token)
    held[a.token] = ours
  end
  if ours then
    redis.call('XADD', k.events, '*', 'e', a.event)
    appended[i] = 1
  else
    appended[i] = 0
  end
end
return appended
