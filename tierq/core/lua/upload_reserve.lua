-- ARGV: member, total bytes wanted, room (quota less committed bytes), `ended` as read
-- before that figure. -2: the lease lapsed; -3: the figure is stale; -1: no room; else the
-- most this upload may hold as of now (room less the other live uploads' reservations).
local t = redis.call('TIME')
local now = tonumber(t[1]) + tonumber(t[2]) / 1000000
local held = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not held or tonumber(held) < now then return -2 end
if (redis.call('GET', KEYS[3]) or '0') ~= ARGV[4] then return -3 end
local others = 0
local all = redis.call('HGETALL', KEYS[2])
for i = 1, #all, 2 do
  if all[i] ~= ARGV[1] then
    local score = redis.call('ZSCORE', KEYS[1], all[i])
    if score and tonumber(score) >= now then others = others + tonumber(all[i + 1]) end
  end
end
local room = tonumber(ARGV[3]) - others
if tonumber(ARGV[2]) > room then return -1 end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
return room
