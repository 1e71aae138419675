-- KEYS: lease, workers hash. ARGV: value, group, then for each job: worker id, inbox,
-- stream, entry id, n, and n field/value strings. Each job whose worker is still there and
-- taking work (its heartbeat present, not draining, its engine alive): XADD to the inbox,
-- XACK and XDEL its source entry. Any other is left pending on its stream, so that a
-- retiring worker's deleted inbox is never made again (a stream nobody reads) from an old
-- snapshot of the heartbeats. Returns 1 or 0 a job: handed off or left.
if redis.call('GET', KEYS[1]) ~= ARGV[1] then return -1 end
local group = ARGV[2]
local i = 3
local moved = {}
local taking = {}
while i <= #ARGV do
  local worker, inbox, stream, id = ARGV[i], ARGV[i + 1], ARGV[i + 2], ARGV[i + 3]
  local n = tonumber(ARGV[i + 4])
  if taking[worker] == nil then
    local hb = redis.call('HGET', KEYS[2], worker)
    local ok = false
    if hb then
      local decoded = cjson.decode(hb)
      ok = decoded['draining'] ~= true and decoded['engine_ok'] ~= false
    end
    taking[worker] = ok
  end
  if taking[worker] then
    local fields = {'XADD', inbox, '*'}
    for j = 1, n do fields[#fields + 1] = ARGV[i + 4 + j] end
    redis.call(unpack(fields))
    redis.call('XACK', stream, group, id)
    redis.call('XDEL', stream, id)
    moved[#moved + 1] = 1
  else
    moved[#moved + 1] = 0
  end
  i = i + 5 + n
end
return moved
