-- ARGV: member, the counter's TTL, 1 if the upload's row committed (then only, the counter
-- moves: a refused upload only gives room back, which a stale figure never overcounts).
redis.call('ZREM', KEYS[1], ARGV[1])
redis.call('HDEL', KEYS[2], ARGV[1])
if ARGV[3] == '1' then
  redis.call('INCR', KEYS[3])
  redis.call('EXPIRE', KEYS[3], tonumber(ARGV[2]))
end
return 1
