-- Undo an admission whose messages RabbitMQ refused or did not confirm: the batch's new jobs
-- are forgotten (a message of theirs that landed is stale) and the jobs it joined lose a
-- follower. A job a worker took already (its message landed, the confirm was lost) stays: it
-- runs once, and a resend with its idempotency key finds it. A new job's record gone (or never
-- made: its admit failed) leaves a tombstone, `<job>:gone`, for `gone_ttl_ms`: a message of
-- its that landed is then stale at once (take.lua), not held as one met before its record.
-- KEYS: none; per item: job, idem, inflight, waiting, unpub
-- An admit whose answer was lost (`made_at`, its `now`) is guessed to have made each job: only
-- a record it made (enqueued at `made_at`) is taken back, not an older one it re-pointed at its
-- message for a resend (that job was accepted before, and stands).
-- ARGV: job_prefix, gone_ttl_ms; per item: job_id, created, joined, msg, made_at
-- Returns nothing.
for i = 1, N do
  local k, a = item(i)
  local h = redis.call('HMGET', k.job, 'status', 'msg', 'enq_at')
  local ours = h[1] == 'queued' and h[2] == a.msg and (a.made_at == '' or h[3] == a.made_at)
  if a.created == '1' and (not h[1] or ours) then
    redis.call('DEL', k.job)
    redis.call('SET', k.job .. ':gone', 1, 'PX', A.gone_ttl_ms)
    redis.call('ZREM', k.waiting, a.job_id)
    redis.call('ZREM', k.unpub, a.job_id)
    if redis.call('GET', k.idem) == a.job_id then redis.call('DEL', k.idem) end
    if redis.call('GET', k.inflight) == a.job_id then redis.call('DEL', k.inflight) end
  elseif a.joined ~= '' then
    redis.call('HINCRBY', A.job_prefix .. a.joined, 'followers', -1)
  end
end
return 0
