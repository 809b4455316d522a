-- Compare-and-set an API batch's state (ApiBatches.set_state): a cancel racing a validation, one wins.
--
-- KEYS[1] the batch's hash
-- ARGV[1] the state it must be in now
-- ARGV[2] the new state
-- ARGV[3..] field, value pairs written with it (errors, total, ended_at)
-- Returns 1 when set, 0 when the batch is missing or in another state.
local cur = redis.call('HGET', KEYS[1], 'state')
if cur ~= ARGV[1] then return 0 end
redis.call('HSET', KEYS[1], 'state', ARGV[2])
for i = 3, #ARGV, 2 do redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1]) end
return 1
