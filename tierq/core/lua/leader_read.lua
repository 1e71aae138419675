-- KEYS: lease, then the streams. ARGV: value, group, consumer, count, then an id a stream.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local n = #KEYS - 1
local args = {'XREADGROUP', 'GROUP', ARGV[2], ARGV[3], 'COUNT', ARGV[4], 'STREAMS'}
for i = 2, #KEYS do args[#args + 1] = KEYS[i] end
for i = 1, n do args[#args + 1] = ARGV[4 + i] end
local got = redis.call(unpack(args))
if not got then return {} end
return got
