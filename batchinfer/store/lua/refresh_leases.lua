-- Refresh a worker's batch leases (batchinfer.workers.service.keeper): re-claim, resetting the idle time,
-- only the entries this consumer still owns, atomically, so a lease the scheduler just took over
-- by XAUTOCLAIM is never taken back.
--
-- KEYS[1] batches stream {p}:batches:<model>
-- ARGV[1] group
-- ARGV[2] consumer
-- ARGV[3..] entry ids
-- Returns the ids kept.
local kept = {}
for i = 3, #ARGV do
  local p = redis.call('XPENDING', KEYS[1], ARGV[1], ARGV[i], ARGV[i], 1)
  if p[1] and p[1][2] == ARGV[2] then
    redis.call('XCLAIM', KEYS[1], ARGV[1], ARGV[2], 0, ARGV[i], 'JUSTID')
    kept[#kept + 1] = ARGV[i]
  end
end
return kept
