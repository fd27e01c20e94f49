-- Claim up to `slots` jobs from the lanes in the given order; finish expired ones on the way.
-- KEYS: lane_1 .. lane_n (claim order), delayed, counters
-- ARGV: group, consumer, slots, now, job_prefix, event_prefix, expired_result, expired_event,
--       ttl_ms, n_lanes
-- Returns {claimed, last_ids, next_due}: claimed = {{lane, entry_id, spec, attempt, resumable}};
-- when nothing was claimed, last_ids holds each lane's last id so the caller can block on XREAD.
local group, consumer = ARGV[1], ARGV[2]
local remaining = tonumber(ARGV[3])
local now = ARGV[4]
local nowf = tonumber(now)
local job_prefix, event_prefix = ARGV[5], ARGV[6]
local ttl = ARGV[9]
local n = tonumber(ARGV[10])
local delayed, counters = KEYS[n + 1], KEYS[n + 2]

local terminal = {succeeded = true, failed = true, cancelled = true, expired = true, dead = true}

-- Retries whose backoff is over go back to their lanes; any worker does this.
local due = redis.call('ZRANGEBYSCORE', delayed, '-inf', now, 'LIMIT', 0, 256)
for _, jid in ipairs(due) do
  redis.call('ZREM', delayed, jid)
  local jk = job_prefix .. jid
  local lane = redis.call('HGET', jk, 'lane')
  if lane and not terminal[redis.call('HGET', jk, 'status')] then
    redis.call('XADD', lane, '*', 'j', jid)
  end
end

local claimed = {}
for i = 1, n do
  local lane = KEYS[i]
  if redis.call('EXISTS', lane) == 0 then
    redis.call('XGROUP', 'CREATE', lane, group, '0', 'MKSTREAM')
  end
  while remaining > 0 do
    local res = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', remaining,
      'STREAMS', lane, '>')
    if not res then break end
    local entries = res[1][2]
    if #entries == 0 then break end
    for _, entry in ipairs(entries) do
      local eid, jid = entry[1], entry[2][2]
      local jk = job_prefix .. jid
      local h = redis.call('HMGET', jk, 'status', 'spec', 'deadline', 'deliveries')
      if (not h[1]) or terminal[h[1]] then
        -- cancelled while waiting, or its record is gone: nothing to run
        redis.call('XACK', lane, group, eid)
        redis.call('XDEL', lane, eid)
      elseif h[3] and h[3] ~= '' and tonumber(h[3]) < nowf then
        redis.call('XACK', lane, group, eid)
        redis.call('XDEL', lane, eid)
        redis.call('HSET', jk, 'status', 'expired', 'result', ARGV[7], 'end_at', now)
        redis.call('PEXPIRE', jk, ttl)
        local ek = event_prefix .. jid
        redis.call('XADD', ek, '*', 'e', ARGV[8])
        redis.call('PEXPIRE', ek, ttl)
        redis.call('HINCRBY', counters, 'expired', 1)
      else
        local deliveries = tonumber(h[4] or '0') + 1
        redis.call('HSET', jk, 'status', 'running', 'start_at', now, 'worker', consumer,
          'deliveries', deliveries)
        local resumable = redis.call('EXISTS', event_prefix .. jid)
        claimed[#claimed + 1] = {lane, eid, h[2], deliveries - 1, resumable}
        remaining = remaining - 1
      end
    end
  end
end

local last_ids = {}
if #claimed == 0 then
  for i = 1, n do
    local info = redis.call('XINFO', 'STREAM', KEYS[i])
    for j = 1, #info, 2 do
      if info[j] == 'last-generated-id' then last_ids[i] = info[j + 1] end
    end
  end
end
local next_due = redis.call('ZRANGE', delayed, 0, 0, 'WITHSCORES')
return {claimed, last_ids, next_due[2] or ''}
