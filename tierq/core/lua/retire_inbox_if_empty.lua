-- Delete a worker's inbox and its heartbeat, if (and only if) the inbox is empty.
if redis.call('XLEN', KEYS[1]) > 0 then return 0 end
redis.call('DEL', KEYS[1])
redis.call('HDEL', KEYS[2], ARGV[1])
return 1
