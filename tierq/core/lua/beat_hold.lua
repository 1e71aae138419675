-- KEYS: the beat lease. ARGV: this beat's name, the lease in ms.
-- Take the lease if it is free or already ours (and renew it): 1; else 0.
local held = redis.call('GET', KEYS[1])
if held == ARGV[1] or not held then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
return 0
