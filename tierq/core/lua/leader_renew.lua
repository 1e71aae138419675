-- KEYS: the dispatcher's lease. ARGV: its holder's value, the lease in ms. Extends the
-- lease while it is still this holder's: 1, else 0 (it lapsed, another leads).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return 0 end
redis.call('PEXPIRE', KEYS[1], ARGV[2])
return 1
