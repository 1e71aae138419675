-- Rewrite a lost replay buffer: every event (ARGV[3..]) in order; the ones after the first
-- ARGV[2] (those never written) are also published with their sequence numbers.
redis.call('DEL', KEYS[1])
local written = tonumber(ARGV[2])
for i = 3, #ARGV do
  redis.call('RPUSH', KEYS[1], ARGV[i])
  if i - 2 > written then redis.call('PUBLISH', KEYS[2], (i - 2) .. '|' .. ARGV[i]) end
end
redis.call('EXPIRE', KEYS[1], ARGV[1])
return #ARGV - 2
