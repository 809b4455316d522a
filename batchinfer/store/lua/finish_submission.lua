-- End a job's submission: record its total and leave `validating`.
--
-- KEYS[1] job hash
-- ARGV[1] total number of requests
-- ARGV[2] now (ms since the epoch)
-- Returns -1 when the job does not exist, else 1 if this call made the job final (the caller
-- enqueues the export), 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return -1
end
redis.call('HSET', KEYS[1], 'total', ARGV[1])
if redis.call('HGET', KEYS[1], 'status') == 'validating' then
  redis.call('HSET', KEYS[1], 'status', 'in_progress', 'in_progress_at', ARGV[2])
end
return maybe_finalize(KEYS[1], ARGV[2])
