-- Record a failed export (batchinfer.jobs.export): append the message to `errors` (a JSON list,
-- the last 20 kept) and set `export_error`; after the last retry a `finalizing` or `cancelling`
-- job becomes `failed`.
--
-- KEYS[1] job hash
-- ARGV[1] message
-- ARGV[2] now (ms since the epoch)
-- ARGV[3] '1' when no retry is left, else '0'
-- Returns 0 for no job, else 1.
if redis.call('EXISTS', KEYS[1]) == 0 then return 0 end
local errors = {}
local raw = redis.call('HGET', KEYS[1], 'errors')
if raw then
  local ok, value = pcall(cjson.decode, raw)
  if ok and type(value) == 'table' then errors = value end
end
table.insert(errors, ARGV[1])
while #errors > 20 do table.remove(errors, 1) end
redis.call('HSET', KEYS[1], 'errors', cjson.encode(errors), 'export_error', ARGV[1])
local st = redis.call('HGET', KEYS[1], 'status')
if ARGV[3] == '1' and (st == 'finalizing' or st == 'cancelling') then
  redis.call('HSET', KEYS[1], 'status', 'failed', 'failed_at', ARGV[2])
end
return 1
