-- KEYS: the dispatcher's lease, its epoch counter. ARGV: the holder, the lease in ms.
-- The epoch when taken; else -(1 + the milliseconds the holder's lease has left), or -1
-- for a lease without an expiry (set by hand: nothing tells when it ends).
if redis.call('EXISTS', KEYS[1]) == 1 then
  local left = redis.call('PTTL', KEYS[1])
  if left >= 0 then return -(left + 1) end
  return -1
end
local epoch = redis.call('INCR', KEYS[2])
redis.call('SET', KEYS[1], epoch .. ':' .. ARGV[1], 'PX', ARGV[2])
return epoch
