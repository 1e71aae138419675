-- KEYS: lease, the set of streams with new entries. ARGV: value, group, inbox, entry id,
-- stream ("" for none), n, then n field/value strings: a dead worker's entry back on its
-- tier's stream (or just dropped).
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n = tonumber(ARGV[6])
if ARGV[5] ~= '' then
  local fields = {'XADD', ARGV[5], '*'}
  for j = 1, n do fields[#fields + 1] = ARGV[6 + j] end
  redis.call(unpack(fields))
  redis.call('SADD', KEYS[2], ARGV[5])
end
redis.call('XACK', ARGV[3], ARGV[2], ARGV[4])
redis.call('XDEL', ARGV[3], ARGV[4])
return 1
