-- Publish one result row exactly once.
--
-- KEYS[1] guard: bitmap {p}:published:<job> (bit idx), or string {p}:published:direct:<request_id>
-- KEYS[2] results stream ({p}:results:<job> or {p}:results:direct)
-- KEYS[3] job hash ({p}:job:<job>; ignored for direct requests)
-- KEYS[4] redelivery hash {p}:redelivery:<request_id> (exists only for requests sent with a
--         client_request_id: claim_request.lua creates it at intake)
-- KEYS[5] optional reply_to stream
-- ARGV[1] idx within the job, or -1 for a direct request
-- ARGV[2] the row (JSON)
-- ARGV[3] counter to bump: the row's status ('completed', 'failed', 'cancelled' or 'expired')
-- ARGV[4] now (ms since the epoch)
-- ARGV[5] TTL (seconds) of a direct request's guard, and of a reply stream after its last row
-- ARGV[6] retention of results:direct: entries older than this id (ms) are trimmed (MINID ~)
-- Returns {published, finalizing, skipped, dropped}: 0/1 integers, and the reply streams (reply_to
-- or a retry's) that were not written because the key is not a stream. dropped = 1: a job's row
-- whose job has no record (deleted, or lost by a Redis restart without persistence): nothing was
-- written, so no orphan results stream (with no TTL, no export to end it) is ever created.
local idx = tonumber(ARGV[1])
if idx < 0 then
  if not redis.call('SET', KEYS[1], '1', 'NX', 'EX', ARGV[5]) then
    return {0, 0, {}, 0}
  end
elseif redis.call('EXISTS', KEYS[3]) == 0 then
  return {0, 0, {}, 1}
elseif redis.call('SETBIT', KEYS[1], idx, 1) == 1 then
  return {0, 0, {}, 0}
end
if idx < 0 then
  -- results:direct has no export that ends it: time-based retention, trimmed as rows arrive
  -- (~: whole stream nodes only, so the trim costs next to nothing)
  redis.call('XADD', KEYS[2], 'MINID', '~', ARGV[6], '*', 'row', ARGV[2])
else
  redis.call('XADD', KEYS[2], '*', 'row', ARGV[2])
end
local skipped = {}
if #KEYS >= 5 and not deliver_row(KEYS[5], ARGV[2], ARGV[5]) then
  table.insert(skipped, KEYS[5])
end
if redis.call('EXISTS', KEYS[4]) == 1 then
  -- a request with a client_request_id: deliver to the retries waiting on other reply streams,
  -- and keep the row for retries still to come (the hash expires with the idempotency key).
  -- Those streams are not in KEYS: on Redis Cluster every reply stream must carry the prefix's
  -- hash tag (docs/protocol.md), which puts it in this slot.
  local f = redis.call('HGETALL', KEYS[4])
  for i = 1, #f, 2 do
    if f[i + 1] == '0' and string.sub(f[i], 1, 3) == 'to:' then
      local stream = string.sub(f[i], 4)
      if not deliver_row(stream, ARGV[2], ARGV[5]) then
        table.insert(skipped, stream)
      end
      redis.call('HSET', KEYS[4], f[i], '1')
    end
  end
  redis.call('HSET', KEYS[4], 'row', ARGV[2])
end
if idx < 0 then
  return {1, 0, skipped, 0}  -- direct requests have no counters to keep
end
redis.call('HINCRBY', KEYS[3], ARGV[3], 1)
return {1, maybe_finalize(KEYS[3], ARGV[4]), skipped, 0}
