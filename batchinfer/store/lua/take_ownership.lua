-- Take a scheduler's ownership when it is free, or held by an earlier holder of the same label
-- (an earlier scheduler object of this very process: host and pid).
--
-- KEYS[1] the ownership key ({p}:scheduler:owner)
-- ARGV[1] the new holder's token (its label, ':', a random part)
-- ARGV[2] the label followed by ':'
-- ARGV[3] the time to live (ms)
-- Returns 1 when taken, 0 when another scheduler holds it.
local holder = redis.call('GET', KEYS[1])
if holder and string.sub(holder, 1, #ARGV[2]) ~= ARGV[2] then
  return 0
end
redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[3])
return 1
