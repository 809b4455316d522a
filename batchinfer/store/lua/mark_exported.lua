-- Settle a job whose results file was written (batchinfer.jobs.export): record where (and its
-- error file's, and the rows' token sums), and move
-- `finalizing` -> `completed`, `cancelling` -> `cancelled` (an `expired` job stays expired; a
-- `failed` one whose export failed earlier and now succeeded becomes `completed`).
--
-- KEYS[1] job hash
-- KEYS[2] cancelled set {p}:cancelled
-- KEYS[3] results stream, KEYS[4] guard bitmap, KEYS[5] attempts hash, KEYS[6] admissions bitmap
--         (all get the TTL: nothing of an exported job stays in Redis for good)
-- ARGV[1] output location
-- ARGV[2] now (ms since the epoch)
-- ARGV[3] TTL (seconds) of the job's results stream, guard and attempts
-- ARGV[4] job id
-- ARGV[5] error file location (OpenAI's error file, written beside the output), '' for none (removed)
-- ARGV[6..8] prompt_tokens, completion_tokens, cached_tokens: sums over the job's rows (its usage)
-- Returns the final status, or false for no job.
local st = redis.call('HGET', KEYS[1], 'status')
if not st then return false end
local final = st
if st == 'finalizing' or (st == 'failed' and redis.call('HEXISTS', KEYS[1], 'export_error') == 1) then
  final = 'completed'
elseif st == 'cancelling' then
  final = 'cancelled'
end
redis.call('HSET', KEYS[1], 'output', ARGV[1], 'exported_at', ARGV[2], 'prompt_tokens', ARGV[6],
           'completion_tokens', ARGV[7], 'cached_tokens', ARGV[8])
-- the record names the files written: one file of every row (an export to a caller's own output) has no
-- error file
if ARGV[5] ~= '' then redis.call('HSET', KEYS[1], 'error_output', ARGV[5])
else redis.call('HDEL', KEYS[1], 'error_output') end
if final ~= st then redis.call('HSET', KEYS[1], 'status', final, final .. '_at', ARGV[2]) end
redis.call('HDEL', KEYS[1], 'export_error')
redis.call('SREM', KEYS[2], ARGV[4])
for i = 3, #KEYS do redis.call('EXPIRE', KEYS[i], ARGV[3]) end
return final
