-- KEYS: a lease's key. ARGV: its holder's value. Delete the key only while it still holds
-- that value: a lease that lapsed and was taken by another meanwhile stays theirs.
-- Returns 1 if it was deleted, else 0.
if redis.call('GET', KEYS[1]) == ARGV[1] then return redis.call('DEL', KEYS[1]) end
return 0
