-- Take a scheduler's ownership when it is free, or held by an earlier holder of the same label
-- (an earlier scheduler object of this very process: host and pid), and start a new epoch.
--
-- KEYS[1] the ownership key ({p}:scheduler:owner): the holder's token, with a time to live
-- KEYS[2] the epoch key ({p}:scheduler:epoch): bumped at every change of holder, never expires
-- ARGV[1] the new holder's token (its label, ':', a random part)
-- ARGV[2] the label followed by ':'
-- ARGV[3] the time to live (ms)
-- Returns the new epoch (>= 1) when taken, 0 when another scheduler holds it.
local holder = redis.call('GET', KEYS[1])
if holder and string.sub(holder, 1, #ARGV[2]) ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return redis.call('INCR', KEYS[2])
