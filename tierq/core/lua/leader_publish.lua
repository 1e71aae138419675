-- KEYS: lease. ARGV: value, then channel/message pairs.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
for i = 2, #ARGV, 2 do redis.call('PUBLISH', ARGV[i], ARGV[i + 1]) end
return 1
