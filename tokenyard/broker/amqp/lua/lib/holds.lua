-- Whether `consumer` still holds the job's lease `token` (the fence of every lease holder's write).
local function holds(job, consumer, token)
  local h = redis.call('HMGET', job, 'status', 'worker', 'lease')
  return h[1] == 'running' and h[2] == consumer and h[3] == token
end
