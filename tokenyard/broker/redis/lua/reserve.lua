-- Reserve one tenant's quota for a batch of jobs, each decided alone (tokenyard.tenancy.limiter
-- is the same maths in Python): concurrency cap, then GCRA on requests and on tokens per minute,
-- then the token budget of the current period (day | month: UTC calendar; seconds: windows
-- aligned to the epoch). An admitted job is held
-- (job -> "reserved tokens|seconds per token|reserved at|budget period start or ''|seconds
-- per request") until settle.lua releases it.
-- KEYS: quota, held
-- ARGV: now, rpm, tpm, max_concurrent, budget, budget_period; per item: job_id, tokens
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
local budget = tonumber(A.budget)
local period = 60.0
local s = redis.call('HMGET', K.quota, 'rpm_tat', 'tpm_tat', 'active', 'budget_start',
  'budget_used')
local rtat, ttat, active = tonumber(s[1]) or 0, tonumber(s[2]) or 0, tonumber(s[3]) or 0

-- days since the epoch of a civil date, and back (H. Hinnant's algorithms): months in Lua
local function days_from_civil(y, m, d)
  if m <= 2 then y = y - 1 end
  local era = math.floor(y / 400)
  local yoe = y - era * 400
  local mp = (m > 2) and (m - 3) or (m + 9)
  local doy = math.floor((153 * mp + 2) / 5) + d - 1
  local doe = yoe * 365 + math.floor(yoe / 4) - math.floor(yoe / 100) + doy
  return era * 146097 + doe - 719468
end

local function civil_from_days(days)
  local z = days + 719468
  local era = math.floor(z / 146097)
  local doe = z - era * 146097
  local yoe = math.floor((doe - math.floor(doe / 1460) + math.floor(doe / 36524)
    - math.floor(doe / 146096)) / 365)
  local doy = doe - (365 * yoe + math.floor(yoe / 4) - math.floor(yoe / 100))
  local mp = math.floor((5 * doy + 2) / 153)
  local m = (mp < 10) and (mp + 3) or (mp - 9)
  local y = yoe + era * 400
  if m <= 2 then y = y + 1 end
  return y, m
end

local bstart, bend = 0, 0
if budget > 0 then
  if A.budget_period == 'month' then
    local y, m = civil_from_days(math.floor(now / 86400))
    bstart = days_from_civil(y, m, 1) * 86400
    if m == 12 then y, m = y + 1, 1 else m = m + 1 end
    bend = days_from_civil(y, m, 1) * 86400
  else
    local len = 86400
    if A.budget_period ~= 'day' then len = tonumber(A.budget_period) end
    bstart = math.floor(now / len) * len
    bend = bstart + len
  end
end
local used = 0
if budget > 0 and tonumber(s[4]) == bstart then used = tonumber(s[5]) or 0 end

local function remaining_before(tat, limit)
  local interval = period / limit
  local base = math.max(tat, now)
  return math.max(0, math.floor((period - (base - now)) / interval + 1e-6)), base - now
end

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
  elseif budget > 0 and used + tokens > budget then
    admitted, reason, retry = 0, 'budget', bend - now
    if tokens > budget then reason, retry = 'too_large', -1 end
  end
  if admitted == 1 then
    rtat, ttat, active = rnew, tnew, active + 1
    local per_token, per_request = 0, 0
    if tpm > 0 then per_token = period / tpm end
    if rpm > 0 then per_request = period / rpm end
    local bmark = ''
    if budget > 0 then
      used = used + tokens
      bmark = f(bstart)
    end
    redis.call('HSET', K.held, a.job_id,
      tokens .. '|' .. f(per_token) .. '|' .. f(now) .. '|' .. bmark .. '|' .. f(per_request))
  else
    -- a refusal takes nothing: what remains is what remained before it
    if rpm > 0 then rrem, rreset = remaining_before(rtat, rpm) end
    if tpm > 0 then trem, treset = remaining_before(ttat, tpm) end
  end
  out[i] = {admitted, reason, f(retry), rrem, f(rreset), trem, f(treset)}
end
redis.call('HSET', K.quota, 'rpm_tat', f(rtat), 'tpm_tat', f(ttat), 'active', active)
if budget > 0 then
  redis.call('HSET', K.quota, 'budget_start', f(bstart), 'budget_used', used)
end
return out
