-- The jobs whose producer died between their record and their message, and that no resend
-- finished (the reaper's): in a lane's `unpub` set since before `before`, still queued and
-- never confirmed published. Each is pointed at a fresh message (`msg_prefix` and its place
-- in the answer), which the caller publishes and then marks, as an enqueue does; a crash in
-- between leaves it here for the next reap. Entries whose job was published, taken or ended
-- meanwhile are dropped from the set on the way.
-- KEYS: none; per item: unpub
-- ARGV: before, max_entries, job_prefix, msg_prefix
-- Returns per item {{job_id, spec, msg}, ...}.
local out, n = {}, 0
for i = 1, N do
  local k = item(i)
  local found = {}
  local ids = redis.call('ZRANGEBYSCORE', k.unpub, '-inf', A.before, 'LIMIT', 0, A.max_entries)
  for _, jid in ipairs(ids) do
    local jk = A.job_prefix .. jid
    local h = redis.call('HMGET', jk, 'status', 'pub', 'spec')
    if h[1] == 'queued' and h[2] == '0' then
      n = n + 1
      local msg = A.msg_prefix .. n
      redis.call('HSET', jk, 'msg', msg)
      found[#found + 1] = {jid, h[3], msg}
    else
      redis.call('ZREM', k.unpub, jid)
    end
  end
  out[i] = found
end
return out
