-- Extend leases still held: each one's deadline in its lane's lease set moves on.
-- KEYS: none; per item: job, leases
-- ARGV: deadline; per item: consumer, token, job_id
-- Returns one flag per item: 1 renewed, 0 lost.
local renewed = {}
for i = 1, N do
  local k, a = item(i)
  if holds(k.job, a.consumer, a.token) then
    redis.call('ZADD', k.leases, A.deadline, a.job_id)
    renewed[i] = 1
  else
    renewed[i] = 0
  end
end
return renewed
