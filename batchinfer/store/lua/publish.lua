-- Publish one result row exactly once (publish_row, in the publish_row.lua prelude).
--
-- KEYS[1] guard: bitmap {p}:published:<job> (bit idx), or string {p}:published:direct:<request_id>
-- KEYS[2] results stream ({p}:results:<job> or {p}:results:direct)
-- KEYS[3] job hash ({p}:job:<job>; ignored for direct requests)
-- KEYS[4] redelivery hash {p}:redelivery:<request_id>
-- KEYS[5] optional reply_to stream
-- ARGV[1] idx within the job, or -1 for a direct request
-- ARGV[2] the row (JSON)
-- ARGV[3] counter to bump: the row's status ('completed', 'failed', 'cancelled' or 'expired')
-- ARGV[4] now (ms since the epoch)
-- ARGV[5] TTL (seconds) of a direct request's guard, and of a reply stream after its last row
-- ARGV[6] retention of results:direct: entries older than this id (ms) are trimmed (MINID ~)
-- Returns {published, finalizing, skipped, dropped}: see publish_row.
local published, finalizing, skipped, dropped = publish_row(
  KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5] or false,
  tonumber(ARGV[1]), ARGV[2], ARGV[3], ARGV[4], ARGV[5], ARGV[6])
return {published, finalizing, skipped, dropped}
