-- Give a scheduler's ownership up (a clean stop), only while it is still this holder's.
--
-- KEYS[1] the ownership key ({p}:scheduler:owner)
-- ARGV[1] the holder's token
-- Returns 1 when released, 0 when it was not held by this token.
if redis.call('GET', KEYS[1]) == ARGV[1] then
  redis.call('DEL', KEYS[1])
  return 1
end
return 0
