-- KEYS: uploads (zset), bytes (hash), ended (counter). ARGV: limit (0: none), lease, member.
-- Drops lapsed leases and their reservations, refuses at the limit, else adds this one.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
for _, m in ipairs(redis.call('ZRANGEBYSCORE', KEYS[1], '-inf', now)) do
  redis.call('HDEL', KEYS[2], m)
end
redis.call('ZREMRANGEBYSCORE', KEYS[1], '-inf', now)
-- A retry after a lost reply: this upload already holds its slot.
if redis.call('ZSCORE', KEYS[1], ARGV[3]) then return 1 end
local limit = tonumber(ARGV[1])
if limit > 0 and redis.call('ZCARD', KEYS[1]) >= limit then return 0 end
local ttl = math.ceil(tonumber(ARGV[2])) + 1
redis.call('ZADD', KEYS[1], now + tonumber(ARGV[2]), ARGV[3])
redis.call('HSET', KEYS[2], ARGV[3], 0)
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return 1
