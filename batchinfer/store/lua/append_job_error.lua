-- Append one message to a job's `errors` (a JSON list), keeping at most ARGV[2] entries (the last
-- one then says that further errors were not recorded). A missing job is not created.
--
-- KEYS[1] job hash
-- ARGV[1] message
-- ARGV[2] the most entries kept
-- Returns 1 when the message was recorded, 0 otherwise.
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 0
end
local cap = tonumber(ARGV[2])
local list = {}
local raw = redis.call('HGET', KEYS[1], 'errors')
if raw and raw ~= '' then
  local ok, decoded = pcall(cjson.decode, raw)
  if ok and type(decoded) == 'table' then
    list = decoded
  end
end
if #list >= cap then
  return 0
end
if #list == cap - 1 then
  list[#list + 1] = '(further errors of this job were not recorded)'
else
  list[#list + 1] = ARGV[1]
end
redis.call('HSET', KEYS[1], 'errors', cjson.encode(list))
return 1
