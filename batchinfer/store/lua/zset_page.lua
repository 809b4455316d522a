-- One page of a listing sorted set (member -> created ms) past a cursor, in one consistent read
-- (FileStore.list, ApiBatches.list).
--
-- KEYS[1] the sorted set
-- ARGV[1] "desc" (highest score first) or "asc"
-- ARGV[2] how many members at most
-- ARGV[3], ARGV[4] (optional) the cursor's score and member: the page holds the members strictly
--   past it in Redis' own (score, member bytes) order, so members of the same millisecond are neither
--   repeated nor skipped, and a cursor removed meanwhile still marks its place.
-- Returns a flat list: member, score, member, score, ...
local key, desc, count = KEYS[1], ARGV[1] == 'desc', tonumber(ARGV[2])
if count <= 0 then return {} end
if ARGV[3] == nil then
  if desc then return redis.call('ZREVRANGE', key, 0, count - 1, 'WITHSCORES') end
  return redis.call('ZRANGE', key, 0, count - 1, 'WITHSCORES')
end
local score, cursor = ARGV[3], ARGV[4]

-- a < b as memcmp orders bytes (string '<' would follow the server's locale)
local function less(a, b)
  local n = math.min(#a, #b)
  for i = 1, n do
    local x, y = string.byte(a, i), string.byte(b, i)
    if x ~= y then return x < y end
  end
  return #a < #b
end

local out = {}
-- members with the cursor's own score (rare: same millisecond), ascending by member
local ties = redis.call('ZRANGEBYSCORE', key, score, score, 'WITHSCORES')
local first, last, step = 1, #ties - 1, 2
if desc then first, last, step = #ties - 1, 1, -2 end
for i = first, last, step do
  if #out >= 2 * count then return out end
  local past = (desc and less(ties[i], cursor)) or ((not desc) and less(cursor, ties[i]))
  if past then out[#out + 1] = ties[i]; out[#out + 1] = ties[i + 1] end
end
local left = count - #out / 2
if left <= 0 then return out end
local rest
if desc then
  rest = redis.call('ZREVRANGEBYSCORE', key, '(' .. score, '-inf', 'WITHSCORES', 'LIMIT', 0, left)
else
  rest = redis.call('ZRANGEBYSCORE', key, '(' .. score, '+inf', 'WITHSCORES', 'LIMIT', 0, left)
end
for i = 1, #rest do out[#out + 1] = rest[i] end
return out
