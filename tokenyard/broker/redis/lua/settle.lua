-- Settle jobs of one tenant: release each one's concurrency slot and refund the tokens it
-- reserved beyond what it used. Idempotent per job: only the call whose HDEL removes the
-- held entry changes the counters, so every terminal path may settle, in any order. The
-- budget is refunded only while the period the job was reserved in is still counting. A job that
-- never entered the queue (request 1) gives its request back too.
-- KEYS: quota, held
-- ARGV: none; per item: job_id, actual, request
-- Returns the number of jobs this call released.
local released = 0
for i = 1, N do
  local _, a = item(i)
  local held = redis.call('HGET', K.held, a.job_id)
  if held and redis.call('HDEL', K.held, a.job_id) == 1 then
    released = released + 1
    -- fields: reserved|per token|at|budget mark|per request (older entries end sooner)
    local f = {}
    for part in string.gmatch(held .. '|', '([^|]*)|') do f[#f + 1] = part end
    local reserved, per_token, bmark = tonumber(f[1]), tonumber(f[2]), f[4] or ''
    local per_request = tonumber(f[5] or '') or 0
    local active = tonumber(redis.call('HGET', K.quota, 'active') or '0')
    redis.call('HSET', K.quota, 'active', math.max(0, active - 1))
    local actual = tonumber(a.actual)
    if a.request == '1' and per_request > 0 then
      local rtat = tonumber(redis.call('HGET', K.quota, 'rpm_tat') or '0')
      redis.call('HSET', K.quota, 'rpm_tat', string.format('%.17g', rtat - per_request))
    end
    if per_token > 0 and actual < reserved then
      local tat = tonumber(redis.call('HGET', K.quota, 'tpm_tat') or '0')
      redis.call('HSET', K.quota, 'tpm_tat',
        string.format('%.17g', tat - (reserved - actual) * per_token))
    end
    if bmark ~= '' and actual < reserved then
      local b = redis.call('HMGET', K.quota, 'budget_start', 'budget_used')
      if b[1] == bmark then
        redis.call('HSET', K.quota, 'budget_used',
          math.max(0, (tonumber(b[2]) or 0) - (reserved - actual)))
      end
    end
  end
end
return released
