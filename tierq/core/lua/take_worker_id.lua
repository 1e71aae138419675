-- Take the id only if its heartbeat is still the one judged (none: ARGV[2] is ''): of two
-- workers starting at once under one id, one takes it and the other judges the winner.
local current = redis.call('HGET', KEYS[1], ARGV[1])
if (current or '') ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[3])
return 1
