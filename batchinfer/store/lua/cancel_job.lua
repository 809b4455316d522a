-- Ask for a job's cancellation (JobStore.cancel): a live job goes `cancelling` and joins the
-- cancelled set in one step; a job that already ended, is already cancelling, or is `finalizing`
-- (every request has its row: nothing is left to cancel, and it must not be reported cancelled)
-- is left alone.
--
-- KEYS[1] job hash
-- KEYS[2] cancelled set {p}:cancelled
-- ARGV[1] job id
-- ARGV[2] now (ms since the epoch)
-- Returns false for no job, else the job's status after the call.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
if cur == 'completed' or cur == 'failed' or cur == 'expired' or cur == 'cancelled' or cur == 'cancelling'
   or cur == 'finalizing' then return cur end
redis.call('HSET', KEYS[1], 'status', 'cancelling', 'cancelling_at', ARGV[2])
redis.call('SADD', KEYS[2], ARGV[1])
return 'cancelling'
