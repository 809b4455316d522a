-- Drop an empty staging stream from its model's set of active streams.
--
-- KEYS[1] staging stream {p}:queue:<model>:<member>
-- KEYS[2] the model's active set {p}:queues:<model>
-- ARGV[1] member
-- Returns 1 when pruned, 0 when the stream still holds entries (an intake write won the race).
if redis.call('XLEN', KEYS[1]) > 0 then
  return 0
end
redis.call('DEL', KEYS[1])
redis.call('ZREM', KEYS[2], ARGV[1])
return 1
