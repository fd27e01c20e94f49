-- Append events to jobs' streams, fenced by the lease token: only its holder speaks for a job
-- (lib/events.lua).
-- KEYS: none; per item: job, events
-- ARGV: none; per item: consumer, token, event
-- Returns one flag per item: 1 appended, 0 fenced off.
return append_held(
  function(_, a) return a.token end,
  function(k, a) return holds(k.job, a.consumer, a.token) end)
