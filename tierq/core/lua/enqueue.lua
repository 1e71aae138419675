-- Jobs onto their streams, in one step (one command and one reply for any number of jobs,
-- where MULTI/EXEC made eight of each for one — a tenth of an admission's CPU in the API).
-- KEYS: the set of jobs Redis holds, the arrivals counter, the dispatcher's wake-up list,
-- the set of streams with new entries (the dispatcher reads those); then for each job its
-- stream, its tier's set of tenants with work and its trace context's key. ARGV, seven
-- for each job: the entry's field and value; the tenant, '' for the head-of-tier stream
-- (else it joins the tier's set); the job; '1' for an arrival (counted, once: a retry of a
-- call whose reply was lost finds the job held already); the job's sampled trace context,
-- kept for the next ARGV's seconds, or ''.
-- Returns the entries' ids, in order; a job that could not be enqueued gets 'error: ' and
-- its error instead (the others are not held up by it), and when none could, the call
-- fails with the first error (so that an unwritable Redis is waited out as before).
local function one(k, a)
  local id = redis.call('XADD', KEYS[k + 1], '*', ARGV[a + 1], ARGV[a + 2])
  redis.call('SADD', KEYS[4], KEYS[k + 1])
  if ARGV[a + 3] ~= '' then redis.call('SADD', KEYS[k + 2], ARGV[a + 3]) end
  local new = redis.call('SADD', KEYS[1], ARGV[a + 4])
  if ARGV[a + 6] ~= '' then
    redis.call('SET', KEYS[k + 3], ARGV[a + 6], 'EX', ARGV[a + 7], 'NX')
  end
  return id, new == 1 and ARGV[a + 5] ~= ''
end
local ids, arrivals, failed, first = {}, 0, 0, nil
for i = 0, (#KEYS - 4) / 3 - 1 do
  local ok, id, arrived = pcall(one, 4 + i * 3, i * 7)
  if ok then
    ids[i + 1] = id
    if arrived then arrivals = arrivals + 1 end
  else
    local why = type(id) == 'table' and id.err or tostring(id)
    ids[i + 1] = 'error: ' .. why
    failed = failed + 1
    first = first or why
  end
end
if failed == #ids then return redis.error_reply(first) end
if arrivals > 0 then redis.call('INCRBY', KEYS[2], arrivals) end
redis.call('LPUSH', KEYS[3], '1')
redis.call('LTRIM', KEYS[3], 0, 0)
return ids
