-- KEYS: lease. ARGV: value, inbox, workers hash, worker id: a dead worker forgotten.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
redis.call('DEL', ARGV[2])
redis.call('HDEL', ARGV[3], ARGV[4])
return 1
