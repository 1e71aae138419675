-- Renew this process's slots of one tenant: only those still there (XX), so a slot let go
-- meanwhile stays gone — unless the whole set is gone (a flush of Redis): then re-add all.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local mode = 'XX'
if redis.call('EXISTS', KEYS[1]) == 0 then mode = 'NX' end
for i = 2, #ARGV do redis.call('ZADD', KEYS[1], mode, now + tonumber(ARGV[1]), ARGV[i]) end
redis.call('EXPIRE', KEYS[1], math.ceil(tonumber(ARGV[1])) + 1)
return #ARGV - 1
