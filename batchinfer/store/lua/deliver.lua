-- Shared prelude of publish.lua and redeliver.lua (prepended when the scripts load).
--
-- deliver_row(stream, row, ttl): XADD the row to a reply stream and push the stream's expiry out
-- by ttl seconds (a reply stream nobody reads any more must not live forever). A key of another
-- type (a producer's mistake) is left alone and false returned: one bad reply_to must never fail
-- the publication of a row, which is still written to its results stream.
local function deliver_row(stream, row, ttl)
  local kind = redis.call('TYPE', stream)['ok']
  if kind ~= 'none' and kind ~= 'stream' then
    return false
  end
  redis.call('XADD', stream, '*', 'row', row)
  redis.call('EXPIRE', stream, ttl)
  return true
end
