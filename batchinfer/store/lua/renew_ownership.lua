-- Keep a scheduler's ownership: extend it only while it is still this holder's.
--
-- KEYS[1] the ownership key ({p}:scheduler:owner)
-- ARGV[1] the holder's token
-- ARGV[2] the new time to live (ms)
-- Returns 1 when renewed, 0 when the key is gone or another holder's (it must stop writing).
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
