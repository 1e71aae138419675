-- Append an event to a job's replay buffer and publish it with its sequence number, in one
-- step, so that the buffer order and the ids seen live are the same. Fenced: an event of a
-- delivery (ARGV[3]) older than the job's newest is refused (0), so a stale run of a job
-- delivered twice can stream nothing; ARGV[3] = '' is unfenced (the API's own events).
-- Checked: given the sequence number the writer expects (ARGV[4]), a buffer shorter than
-- the events before it means Redis lost it (a restart, a flush): -1, and the writer
-- restores the buffer (restore_events.lua) so that ids stay what clients already saw; a buffer
-- that already holds that number means this is a retry of a write that went through
-- before its reply was lost: nothing is appended twice.
-- Bounded: with a byte limit (ARGV[5], deltas only), once the buffer's events pass it the
-- buffer keeps a small placeholder (ARGV[6]) in the event's place — live followers still
-- get the event itself, and the ids stay in step. ARGV[2] is the buffer's time to live.
if ARGV[3] ~= '' then
  local newest = redis.call('GET', KEYS[3])
  if newest and tonumber(newest) > tonumber(ARGV[3]) then return 0 end
end
if ARGV[4] ~= '' then
  local len = redis.call('LLEN', KEYS[1])
  local want = tonumber(ARGV[4])
  if len < want - 1 then return -1 end
  if len >= want then return want end
end
local stored = ARGV[1]
if ARGV[5] ~= '' then
  local size = redis.call('INCRBY', KEYS[4], string.len(ARGV[1]))
  redis.call('EXPIRE', KEYS[4], ARGV[2])
  if size > tonumber(ARGV[5]) then stored = ARGV[6] end
end
local n = redis.call('RPUSH', KEYS[1], stored)
redis.call('EXPIRE', KEYS[1], ARGV[2])
redis.call('EXPIRE', KEYS[4], ARGV[2])
redis.call('PUBLISH', KEYS[2], n .. '|' .. ARGV[1])
return n
