-- Publish one result row exactly once.
--
-- KEYS[1] guard: bitmap {p}:published:<job> (bit idx), or string {p}:published:direct:<request_id>
-- KEYS[2] results stream ({p}:results:<job> or {p}:results:direct)
-- KEYS[3] job hash ({p}:job:<job>; ignored for direct requests)
-- KEYS[4] optional reply_to stream
-- ARGV[1] idx within the job, or -1 for a direct request
-- ARGV[2] the row (JSON)
-- ARGV[3] counter to bump: 'completed' or 'failed'
-- ARGV[4] now (ms since the epoch)
-- ARGV[5] TTL (seconds) of a direct request's guard, and of a reply_to stream after its last row
-- Returns {published, finalizing} as 0/1 integers.
local idx = tonumber(ARGV[1])
if idx < 0 then
  if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[5]) then
    return {0, 0}
  end
elseif redis.call('SETBIT', KEYS[1], idx, 1) == 1 then
  return {0, 0}
end
redis.call('XADD', KEYS[2], '*', 'row', ARGV[2])
if #KEYS >= 4 then
  redis.call('XADD', KEYS[4], '*', 'row', ARGV[2])
  -- a reply stream nobody reads any more (a client that timed out) must not live forever:
  -- each row pushes its expiry out by the guard TTL
  redis.call('EXPIRE', KEYS[4], ARGV[5])
end
if idx < 0 or redis.call('EXISTS', KEYS[3]) == 0 then
  -- direct requests, and jobs nobody created, have no counters to keep
  return {1, 0}
end
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return {1, maybe_finalize(KEYS[3], ARGV[4])}
