-- Append each item's event to its job's stream (k.events) where its caller holds the job:
-- `holder(k, a)` answers, asked once per lease (`lease(k, a)` names it) however many of its
-- events the batch carries. Returns one flag per item: 1 appended, 0 fenced off.
local function append_held(lease, holder)
  local held, appended = {}, {}
  for i = 1, N do
    local k, a = item(i)
    local name = lease(k, a)
    local ours = held[name]
    if ours == nil then
      ours = holder(k, a)
      held[name] = ours
    end
    if ours then
      redis.call('XADD', k.events, '*', 'e', a.event)
      appended[i] = 1
    else
      appended[i] = 0
    end
  end
  return appended
end
