-- KEYS: lease, the set of streams with new entries. ARGV: value, most to take: streams
-- taken out of the set, as the leader only (a deposed leader takes none: they stay for the
-- one that leads).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
return redis.call('SPOP', KEYS[2], ARGV[2])
