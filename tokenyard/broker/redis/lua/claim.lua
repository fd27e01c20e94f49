-- Claim up to `slots` jobs from the lanes, given in claim order; finish expired ones on the way.
-- KEYS: delayed, counters, wake, workers; per item: lane
-- ARGV: group, consumer, slots, now, server_now, job_prefix, event_prefix, expired_event,
--   ttl_ms, wait_hints, window, capped_room, pfx_prefix, pfx_ttl_ms, aff_wait, wake_after;
--   per item: capped, after
-- A lane's other keys hang off its name as broker/redis/keys.py names them (<lane>:fair,
-- :active, :tq:<tenant>, :affq, :affw:<consumer>, :aff; all in the lane's slot): the call sends
-- the lane alone, not six keys and three args more per lane, as every argument costs the server
-- a parse, an allocation and a Lua string on every call; the script builds only the names it
-- uses (every lane's held and staging sets for the one EXISTS, the rest where a lane is read).
-- Before each read a lane's stream is topped up from its tenants' staged jobs in fair order
-- (lib/fair.lua) to the slots asked for plus `window`.
-- Lanes marked capped give at most capped_room jobs together (-1: no cap): a worker keeps
-- room for interactive work however deep the batch lane is.
-- `now` is the caller's clock; when server_now is '1' the server's TIME is used instead (the
-- call waited in a pipeline behind a blocking XREAD, so `now` would be stale by the wait).
-- Prefix affinity (see enqueue.lua): in each lane, the jobs held for this worker come first,
-- then jobs held for any worker longer than aff_wait seconds (so a busy or dead worker's jobs
-- still run); both are added to the lane's affinity stream `aff` and read from it at once, so
-- their leases work like any lane entry's (renew, complete, reap) and `aff` never holds an
-- undelivered entry. A claimed job with a prefix key makes this worker the prefix's owner for
-- pfx_ttl_ms, unless another live worker (heartbeat not lapsed) owns it: ownership is sticky,
-- so a job taken from a busy owner after the wait does not move the prefix off the worker whose
-- cache holds it, and it moves at once when the owner is gone.
-- Returns one flat array (each table a script returns costs the server a reply node and a probe
-- of seven special fields): {#claimed, #last_ids, #expired, claimed..., last_ids..., drained...,
-- next_due, wake_id, expired...}, i.e. the counts, then
-- claimed = six values per job: entry_id, spec, attempt, resumable, affinity, preemptions;
-- expired = the specs of the jobs this claim found past their deadline and ended (the caller
-- writes their audit entries); drained has as many flags as last_ids has ids.
-- When fewer than `slots` were claimed (every lane is drained) and wait_hints is '1', last_ids
-- holds each lane's newest entry id ('0-0' for an empty lane): every entry is delivered now, so
-- an XREAD after those ids wakes on new work only; next_due is when the first retry's backoff
-- or the first held job's affinity wait ends ('' if none); wake_id is the newest id of this
-- worker's wake stream; drained flags each lane read to its end (1) or left unread under the
-- batch cap (0).
-- Cost: `after` is the id a lane's wait hint gave when this worker's last claim left it drained
-- ('' for none), wake_after the wake stream's likewise: a lane with no entry after it (one XREAD
-- over all of them) has had nothing added since, so there is nothing to read and its hint
-- stands; a drained lane gets new work only by an XADD (the blocking wait relies on the same),
-- and a lane with staged jobs is read anyway. Other lanes cost their XREADGROUP (and an
-- XREVRANGE for the hint). Fair-share refills, held jobs and retries are looked at only where
-- one EXISTS over all the lanes' staging (`active`) and held sets and `delayed` says there are
-- some.
local group, consumer, now = A.group, A.consumer, A.now
if A.server_now == '1' then
  local t = redis.call('TIME')
  now = t[1] .. '.' .. string.format('%06d', tonumber(t[2]))
end
local nowf = tonumber(now)
local remaining = tonumber(A.slots)
-- a job's status is one of queued, running or a terminal one (JobStatus): two interned-string
-- comparisons, not a table of the terminal ones built on every call
local function live(status) return status == 'queued' or status == 'running' end
-- Whether any lane holds jobs for a preferred worker, has staged jobs, or any retry waits: one
-- EXISTS over all those sets (an empty sorted set does not exist), and one more per kind only
-- where some do, so idle lanes cost nothing more. sets = {delayed, held 1, active 1, held 2,
-- ...}: lane i's held set is sets[2i], its staging set sets[2i + 1] (kept out of the lane's
-- item table, which growing past its three fields would rehash, per lane and call)
local lks, las, sets = {}, {}, {K.delayed}
for i = 1, N do
  lks[i], las[i] = item(i)
  local lane = lks[i].lane
  sets[2 * i], sets[2 * i + 1] = lane .. ':affq', lane .. ':active'
end
-- lane i's fair-share hash, named the first time a claim touches it
local fairs = {}
local function fair_of(i)
  local fair = fairs[i]
  if not fair then
    fair = lks[i].lane .. ':fair'
    fairs[i] = fair
  end
  return fair
end

-- Retries whose backoff is over go back to their lanes; any worker does this. The earliest one
-- first: when it is not due (or there is none), that is also the wait hint's next_due.
local any_held, any_staged, first_delayed = false, false, {}
if redis.call('EXISTS', unpack(sets)) > 0 then
  local held_keys, active_keys = {}, {}
  for i = 1, N do held_keys[i], active_keys[i] = sets[2 * i], sets[2 * i + 1] end
  any_held = N > 0 and redis.call('EXISTS', unpack(held_keys)) > 0
  any_staged = N > 0 and redis.call('EXISTS', unpack(active_keys)) > 0
  first_delayed = redis.call('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
end
if first_delayed[2] and tonumber(first_delayed[2]) <= nowf then
  local due = redis.call('ZRANGEBYSCORE', K.delayed, '-inf', now, 'LIMIT', 0, 256)
  if #due > 0 then redis.call('ZREM', K.delayed, unpack(due)) end
  for _, jid in ipairs(due) do
    local jk = A.job_prefix .. jid
    local h = redis.call('HMGET', jk, 'lane', 'status')
    if h[1] and (h[2] == nil or live(h[2])) then
      redis.call('XADD', h[1], '*', 'j', jid)
    end
  end
  first_delayed = nil  -- moved some: read again for the hint
end

local function read(lane, count)
  local res = redis.pcall('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
    'STREAMS', lane, '>')
  if type(res) == 'table' and res.err then
    if not string.find(res.err, 'NOGROUP', 1, true) then return redis.error_reply(res.err) end
    -- enqueue makes no group: the first claim of a lane makes it and reads from the start
    redis.call('XGROUP', 'CREATE', lane, group, '0', 'MKSTREAM')
    res = redis.call('XREADGROUP', 'GROUP', group, consumer, 'COUNT', count,
      'STREAMS', lane, '>')
  end
  return res
end

local claimed, last_read, capped_out, expired, held_left = {}, {}, {}, {}, {}
local capped_left = tonumber(A.capped_room)
local aff_wait = tonumber(A.aff_wait)

-- Entries just read from `stream`: skip what has ended or expired, lease the rest.
local function take(stream, entries, capped, affinity)
  for _, entry in ipairs(entries) do
    local eid, jid = entry[1], entry[2][2]
    local jk = A.job_prefix .. jid
    local h = redis.call('HMGET', jk, 'status', 'spec', 'deadline', 'deliveries', 'pfx',
      'start_at', 'preempted')
    if not live(h[1]) then
      -- cancelled while waiting, or its record is gone: nothing to run
      redis.call('XACK', stream, group, eid)
      redis.call('XDEL', stream, eid)
    elseif h[3] and h[3] ~= '' and tonumber(h[3]) < nowf then
      redis.call('XACK', stream, group, eid)
      redis.call('XDEL', stream, eid)
      -- (a waiting job carries no cancel request: cancel.lua ends it at once)
      finish(jk, A.event_prefix .. jid, nil, jid, 'expired', A.expired_event, now, A.ttl_ms, '')
      redis.call('HINCRBY', K.counters, 'expired', 1)
      expired[#expired + 1] = h[2]  -- its spec: the caller audits its end (another slot)
    else
      local deliveries = tonumber(h[4] or '0') + 1
      redis.call('HSET', jk, 'status', 'running', 'start_at', now, 'worker', consumer,
        'deliveries', deliveries)
      if h[5] and h[5] ~= '' then
        -- prefix affinity: this worker's engine is about to cache the prefix
        own_prefix(A.pfx_prefix .. h[5], consumer, K.workers, nowf, A.pfx_ttl_ms)
      end
      -- only a job started before (it has a start_at) can have streamed events: only the lease
      -- holder appends, and a job that ended is skipped above
      local resumable = 0
      if h[6] then resumable = redis.call('EXISTS', A.event_prefix .. jid) end
      local c = #claimed  -- six values per job, flat (see the reply above)
      claimed[c + 1], claimed[c + 2], claimed[c + 3] = eid, h[2], deliveries - 1
      claimed[c + 4], claimed[c + 5], claimed[c + 6] = resumable, affinity, tonumber(h[7] or '0')
      remaining = remaining - 1
      if capped then capped_left = capped_left - 1 end
    end
  end
end

-- Prefix affinity: take up to `room` held jobs, this worker's own first, then overdue ones.
local function take_held(lk, held, room, capped)
  local affw_prefix, aff = lk.lane .. ':affw:', lk.lane .. ':aff'
  local ids = redis.call('ZRANGE', affw_prefix .. consumer, 0, room - 1)
  local seen = {}
  for _, jid in ipairs(ids) do seen[jid] = true end
  if #ids < room then
    local old = redis.call('ZRANGEBYSCORE', held, '-inf', string.format('%.6f',
      nowf - aff_wait), 'LIMIT', 0, room)
    for _, jid in ipairs(old) do
      if #ids >= room then break end
      if not seen[jid] then ids[#ids + 1] = jid; seen[jid] = true end
    end
  end
  if #ids == 0 then return 0 end
  local removed = 0
  for _, jid in ipairs(ids) do
    local pref = redis.call('HGET', A.job_prefix .. jid, 'pref')
    if pref then redis.call('ZREM', affw_prefix .. pref, jid) end
    removed = removed + redis.call('ZREM', held, jid)
    redis.call('XADD', aff, '*', 'j', jid)
  end
  local res = read(aff, #ids)
  if res then take(aff, res[1][2], capped, 1) end
  return removed
end

-- Lanes (and the wake stream) with nothing after the cursor this worker's last claim left.
local quiet, wake_quiet = {}, false
if not any_staged then
  -- XREAD COUNT 1 STREAMS <streams> <ids>, built in one table: the streams, then their ids
  local args, n = {'COUNT', 1, 'STREAMS'}, 3
  for i = 1, N do
    if las[i].after ~= '' then n = n + 1; args[n] = lks[i].lane end
  end
  if A.wake_after ~= '' then n = n + 1; args[n] = K.wake end
  if n > 3 then
    for i = 1, N do
      if las[i].after ~= '' then n = n + 1; args[n] = las[i].after end
    end
    if A.wake_after ~= '' then n = n + 1; args[n] = A.wake_after end
    local woke = {}
    for _, stream in ipairs(redis.call('XREAD', unpack(args)) or {}) do
      woke[stream[1]] = true
    end
    for i = 1, N do quiet[i] = las[i].after ~= '' and not woke[lks[i].lane] end
    wake_quiet = A.wake_after ~= '' and not woke[K.wake]
  end
end

for i = 1, N do
  if remaining <= 0 then break end
  local lk, la = lks[i], las[i]
  local lane = lk.lane
  local capped = la.capped == '1' and capped_left >= 0
  local room = remaining
  if capped then room = math.min(room, capped_left) end
  held_left[i] = any_held and redis.call('ZCARD', sets[2 * i]) or 0
  if room > 0 and held_left[i] > 0 then
    local removed = take_held(lk, sets[2 * i], room, capped)
    -- enqueue.lua's depth check reads this count instead of the set's ZCARD: set from the set
    -- itself, so a count that was never kept (held before it was) is right from here on
    if removed > 0 then redis.call('HSET', fair_of(i), 'held', held_left[i] - removed) end
  end
  -- the lane's fair state, read once where some lane has staged jobs (only this script changes
  -- it while it runs); else only the count of staged jobs in the stream moves, below
  local in_stream, staged, stored = nil, 0, nil
  if any_staged then
    local f = redis.call('HMGET', fair_of(i), 'stream', 'staged')
    in_stream, staged = tonumber(f[1] or '0'), tonumber(f[2] or '0')
    stored = in_stream
  end
  local taken, drained = 0, false
  while remaining > 0 and not quiet[i] do
    local asked = remaining
    if capped then
      -- left unread: its wait hint below is its newest entry, so a wait wakes on new work
      if capped_left <= 0 then capped_out[i] = true; break end
      asked = math.min(asked, capped_left)
    end
    local moved = 0
    if staged > 0 then
      moved, in_stream = fair_refill(lane, fair_of(i), sets[2 * i + 1], lane .. ':tq:',
        asked + tonumber(A.window), in_stream)
      if moved > 0 then staged, stored = staged - moved, in_stream end
    end
    local res = read(lane, asked)
    if not res then break end
    local entries = res[1][2]
    -- the stream was read: that many fewer staged jobs wait in it (a retry added directly is
    -- not counted, so the count never goes below zero)
    taken = taken + #entries
    if in_stream then in_stream = math.max(0, in_stream - #entries) end
    if #entries > 0 then last_read[i] = entries[#entries][1] end
    take(lane, entries, capped, 0)
    if #entries < asked then
      -- the stream is drained, whatever the count said; go on only while jobs are staged
      drained = true
      if in_stream then in_stream = 0 end
      if staged <= 0 or (#entries == 0 and moved == 0) then break end
    end
  end
  if in_stream then
    if in_stream ~= stored then redis.call('HSET', fair_of(i), 'stream', in_stream) end
  elseif taken > 0 then
    -- nothing staged anywhere: the same count, kept without reading it first
    local left = redis.call('HINCRBY', fair_of(i), 'stream', -taken)
    if left < 0 or (drained and left ~= 0) then redis.call('HSET', fair_of(i), 'stream', 0) end
  end
end

local last_ids, next_due, wake_id, drained = {}, '', '0-0', {}
if remaining > 0 and A.wait_hints == '1' then
  for i = 1, N do
    -- a lane read to its end: the last entry read is its newest; a quiet one's stands
    if quiet[i] then
      last_ids[i] = las[i].after
    elseif not capped_out[i] then
      last_ids[i] = last_read[i]
    end
    drained[i] = capped_out[i] and 0 or 1
    if not last_ids[i] then
      local newest = redis.call('XREVRANGE', lks[i].lane, '+', '-', 'COUNT', 1)
      last_ids[i] = newest[1] and newest[1][1] or '0-0'
    end
  end
  local first = first_delayed or redis.call('ZRANGE', K.delayed, 0, 0, 'WITHSCORES')
  local due_at = first[2] and tonumber(first[2]) or math.huge
  for i = 1, N do
    -- a job held for another worker: wake when any worker may take it (one overdue already is
    -- one this claim could not take, e.g. under the batch cap: no reason to wake for it)
    if (held_left[i] or 0) > 0 then
      local held = redis.call('ZRANGE', sets[2 * i], 0, 0, 'WITHSCORES')
      local held_due = held[2] and tonumber(held[2]) + aff_wait
      if held_due and held_due > nowf then due_at = math.min(due_at, held_due) end
    end
  end
  if due_at ~= math.huge then next_due = string.format('%.6f', due_at) end
  if wake_quiet then
    wake_id = A.wake_after
  else
    local newest = redis.call('XREVRANGE', K.wake, '+', '-', 'COUNT', 1)
    wake_id = newest[1] and newest[1][1] or '0-0'
  end
end
local out = {#claimed / 6, #last_ids, #expired}
for _, v in ipairs(claimed) do out[#out + 1] = v end
for _, v in ipairs(last_ids) do out[#out + 1] = v end
for i = 1, #last_ids do out[#out + 1] = drained[i] end
out[#out + 1], out[#out + 2] = next_due, wake_id
for _, v in ipairs(expired) do out[#out + 1] = v end
return out
