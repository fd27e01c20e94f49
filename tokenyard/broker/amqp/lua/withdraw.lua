-- Undo an admission whose messages RabbitMQ refused (a full lane): the batch's new jobs are
-- forgotten (their published messages become stale) and the jobs it joined lose a follower.
-- KEYS: none; per item: job, idem, inflight, waiting
-- ARGV: job_prefix; per item: job_id, created, joined
-- Returns nothing.
for i = 1, N do
  local k, a = item(i)
  if a.created == '1' then
    redis.call('DEL', k.job)
    redis.call('ZREM', k.waiting, a.job_id)
    if redis.call('GET', k.idem) == a.job_id then redis.call('DEL', k.idem) end
    if redis.call('GET', k.inflight) == a.job_id then redis.call('DEL', k.inflight) end
  elseif a.joined ~= '' then
    redis.call('HINCRBY', A.job_prefix .. a.joined, 'followers', -1)
  end
end
return 0
