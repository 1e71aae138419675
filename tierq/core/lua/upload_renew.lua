-- ARGV: lease, member. Extends a lease still held (XX): one that lapsed stays gone.
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local ttl = math.ceil(tonumber(ARGV[1])) + 1
local n = redis.call('ZADD', KEYS[1], 'XX', 'CH', now + tonumber(ARGV[1]), ARGV[2])
redis.call('EXPIRE', KEYS[1], ttl)
redis.call('EXPIRE', KEYS[2], ttl)
return n
