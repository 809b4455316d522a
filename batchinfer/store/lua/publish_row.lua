-- Shared prelude of publish.lua and publish_rows.lua (prepended when the scripts load, after the
-- deliver_row and maybe_finalize preludes it calls).
--
-- publish_row(guard, results, job, redelivery, reply_to, idx, row, counter, now, ttl, minid):
-- publish one result row exactly once.
--   guard: bitmap {p}:published:<job> (bit idx), or string {p}:published:direct:<request_id>
--   results: the results stream ({p}:results:<job> or {p}:results:direct)
--   job: the job hash ({p}:job:<job>; ignored for direct requests)
--   redelivery: hash {p}:redelivery:<request_id> (exists only for requests sent with a
--     client_request_id: claim_request.lua creates it at intake)
--   reply_to: a reply stream, or false
--   idx: the row's idx within its job (a number), or -1 for a direct request
--   counter: the job counter to bump: the row's status ('completed', 'failed', 'cancelled', 'expired')
--   now: ms since the epoch; ttl: seconds a direct request's guard, and a reply stream after its
--   last row, live; minid: results:direct keeps entries from this id (ms) on (MINID ~)
-- Returns published, finalizing, skipped, dropped: 0/1 integers, and the reply streams (reply_to
-- or a retry's) left unwritten because the key is not a stream. dropped = 1: a job's row whose job
-- has no record (deleted, or lost by a Redis restart without persistence): nothing was written,
-- so no orphan results stream (with no TTL, no export to end it) is ever created.
local function publish_row(guard, results, job, redelivery, reply_to, idx, row, counter, now, ttl, minid)
  if idx < 0 then
    if not redis.call('SET', guard, '1', 'NX', 'EX', ttl) then
      return 0, 0, {}, 0
    end
  elseif redis.call('EXISTS', job) == 0 then
    return 0, 0, {}, 1
  elseif redis.call('SETBIT', guard, idx, 1) == 1 then
    return 0, 0, {}, 0
  end
  if idx < 0 then
    -- results:direct has no export that ends it: time-based retention, trimmed as rows arrive
    -- (~: whole stream nodes only, so the trim costs next to nothing)
    redis.call('XADD', results, 'MINID', '~', minid, '*', 'row', row)
  else
    redis.call('XADD', results, '*', 'row', row)
  end
  local skipped = {}
  if reply_to and not deliver_row(reply_to, row, ttl) then
    table.insert(skipped, reply_to)
  end
  if redis.call('EXISTS', redelivery) == 1 then
    -- a request with a client_request_id: deliver to the retries waiting on other reply streams,
    -- and keep the row for retries still to come (the hash expires with the idempotency key).
    -- Those streams are not in KEYS: on Redis Cluster every reply stream must carry the prefix's
    -- hash tag (docs/protocol.md), which puts it in this slot.
    local f = redis.call('HGETALL', redelivery)
    for i = 1, #f, 2 do
      if f[i + 1] == '0' and string.sub(f[i], 1, 3) == 'to:' then
        local stream = string.sub(f[i], 4)
        if not deliver_row(stream, row, ttl) then
          table.insert(skipped, stream)
        end
        redis.call('HSET', redelivery, f[i], '1')
      end
    end
    redis.call('HSET', redelivery, 'row', row)
  end
  if idx < 0 then
    return 1, 0, skipped, 0  -- direct requests have no counters to keep
  end
  redis.call('HINCRBY', job, counter, 1)
  return 1, maybe_finalize(job, now), skipped, 0
end
