-- Record that delivery ARGV[1] of a job runs now; 1 if it is the newest, 0 if a later one
-- already claimed the job.
local newest = tonumber(redis.call('GET', KEYS[1]) or '0')
if newest > tonumber(ARGV[1]) then return 0 end
redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
return 1
