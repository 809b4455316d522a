-- Move a job to a new status, optionally only from some statuses (JobStore.set_status).
--
-- KEYS[1] job hash
-- ARGV[1] the new status
-- ARGV[2] its timestamp field (<status>_at)
-- ARGV[3] now (ms since the epoch)
-- ARGV[4..] the statuses the job may be in now; none = any
-- Returns false when the job does not exist (it is never created), the current status when it
-- is not one of the allowed ones, else 'OK'.
local cur = redis.call('HGET', KEYS[1], 'status')
if not cur then return false end
local ok = (#ARGV == 3)
for i = 4, #ARGV do if ARGV[i] == cur then ok = true end end
if not ok then return cur end
redis.call('HSET', KEYS[1], 'status', ARGV[1], ARGV[2], ARGV[3])
return 'OK'
