-- Open a job: create its record (status `validating`) unless one exists. Run by the scheduler for
-- an `op open` intake entry, and by the Python client before it sends that entry (so that
-- `status` reads the job at once); the second call is then a no-op.
--
-- KEYS[1] job hash
-- KEYS[2] jobs index (sorted set, scored by creation time)
-- ARGV[1] job id
-- ARGV[2] now (ms since the epoch)
-- ARGV[3] completion window (seconds)
-- ARGV[4..] field, value pairs of the record (model, priority, output, output_format, metadata, input_name)
-- Returns 1 when this call created the record, 0 when it existed (then nothing changes).
if redis.call('EXISTS', KEYS[1]) == 1 then
  return 0
end
local now = tonumber(ARGV[2])
local expires = string.format('%d', now + tonumber(ARGV[3]) * 1000)
redis.call('HSET', KEYS[1], 'id', ARGV[1], 'status', 'validating', 'created_at', ARGV[2],
           'completion_window', ARGV[3], 'expires_at', expires, 'priority', '0', 'output_format', 'parquet',
           'metadata', '{}', 'errors', '[]', 'submitted', '0', 'completed', '0', 'failed', '0')
for i = 4, #ARGV, 2 do
  redis.call('HSET', KEYS[1], ARGV[i], ARGV[i + 1])
end
redis.call('ZADD', KEYS[2], ARGV[2], ARGV[1])
return 1
