-- Reserve one tenant's quota for a batch of jobs, each decided alone (tokenyard.tenancy.limiter
-- is the same maths in Python): concurrency cap, then GCRA on requests and on tokens per minute.
-- An admitted job is held (job -> "reserved tokens|seconds per token|reserved at") until
-- settle.lua releases it.
-- KEYS: quota, held
-- ARGV: now, rpm, tpm, max_concurrent; per item: job_id, tokens
-- Time is the server's TIME, one clock for every gateway (their own may be skewed); `now` is
-- used only when it is not '' (tests with an injected clock).
-- Returns per item {admitted 1|0, reason, retry_after, rpm_remaining, rpm_reset,
-- tpm_remaining, tpm_reset}; floats as strings (Lua numbers would reach Redis truncated).
local now = tonumber(A.now)
if A.now == '' then
  local t = redis.call('TIME')
  now = tonumber(t[1]) + tonumber(t[2]) / 1e6
end
local rpm, tpm, maxc = tonumber(A.rpm), tonumber(A.tpm), tonumber(A.max_concurrent)
local period = 60.0
local s = redis.call('HMGET', K.quota, 'rpm_tat', 'tpm_tat', 'active')
local rtat, ttat, active = tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or 0

local function gcra(tat, cost, limit)
  local interval = period / limit
  local base = math.max(tat, now)
  local advanced = base + cost * interval
  local function remaining(t) return math.max(0, math.floor((period - (t - now)) / interval + 1e-6)) end
  if advanced - now <= period + 1e-6 then
    return true, advanced, 0, remaining(advanced), advanced - now
  end
  local retry = advanced - period - now
  if cost > limit then retry = -1 end
  return false, tat, retry, remaining(base), base - now
end

local function f(x) return string.format('%.17g', x) end

local out = {}
for i = 1, N do
  local _, a = item(i)
  local tokens = tonumber(a.tokens)
  local rok, rnew, rretry, rrem, rreset = true, rtat, 0, -1, 0
  local tok, tnew, tretry, trem, treset = true, ttat, 0, -1, 0
  if rpm > 0 then rok, rnew, rretry, rrem, rreset = gcra(rtat, 1, rpm) end
  if tpm > 0 then tok, tnew, tretry, trem, treset = gcra(ttat, tokens, tpm) end
  local admitted, reason, retry = 1, '', 0
  if maxc > 0 and active >= maxc then
    admitted, reason, retry = 0, 'concurrency', 1
  elseif not rok then
    admitted, reason, retry = 0, 'requests', rretry
  elseif not tok then
    admitted, reason, retry = 0, (tretry < 0) and 'too_large' or 'tokens', tretry
  end
  if admitted == 1 then
    rtat, ttat, active = rnew, tnew, active + 1
    local per_token = 0
    if tpm > 0 then per_token = period / tpm end
    redis.call('HSET', K.held, a.job_id, tokens .. '|' .. f(per_token) .. '|' .. f(now))
  end
  out[i] = {admitted, reason, f(retry), rrem, f(rreset), trem, f(treset)}
end
redis.call('HSET', K.quota, 'rpm_tat', f(rtat), 'tpm_tat', f(ttat), 'active', active)
return out
