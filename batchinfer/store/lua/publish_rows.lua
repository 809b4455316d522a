-- Publish many result rows, each exactly once (publish_row, in the publish_row.lua prelude): one
-- call for a worker's rows of one partition, so that a row costs Redis' and the client's work for
-- its own keys and values only, not a command's. Each row is published as publish.lua would.
--
-- ARGV[1] now (ms since the epoch)
-- ARGV[2] TTL (seconds) of a direct request's guard, and of a reply stream after its last row
-- ARGV[3] retention of results:direct: entries older than this id (ms) are trimmed (MINID ~)
-- then per row, in order, four values: idx (-1 for a direct request), the row (JSON), the counter
-- to bump, and its number of keys: 4, or 5 with a reply_to. KEYS: each row's keys, in the same
-- order: guard, results stream, job hash, redelivery hash[, reply_to] (publish.lua's KEYS[1..5]).
-- Returns {codes, skipped, errors}: codes, one character per row: '0' not published (it already
-- was), '1' published, 'f' published and the job made final (its export is the caller's), 'd'
-- dropped (the job has no record), 'e' failed (the error is in errors); skipped: row number (from
-- 1), stream, ... for reply streams left unwritten (not a stream); errors: row number, message, ...
-- A row that fails (e.g. WRONGTYPE on its guard) fails alone: the rows after it are published.
local now, ttl, minid = ARGV[1], ARGV[2], ARGV[3]
local codes, skipped, errors = {}, {}, {}
local k = 1
for r = 1, (#ARGV - 3) / 4 do
  local a = 3 + 4 * (r - 1)
  local nkeys = tonumber(ARGV[a + 4])
  local reply_to = nkeys == 5 and KEYS[k + 4]
  local ok, published, finalizing, skip, dropped = pcall(publish_row,
    KEYS[k], KEYS[k + 1], KEYS[k + 2], KEYS[k + 3], reply_to,
    tonumber(ARGV[a + 1]), ARGV[a + 2], ARGV[a + 3], now, ttl, minid)
  k = k + nkeys
  if not ok then
    codes[r] = 'e'
    table.insert(errors, r)
    table.insert(errors, type(published) == 'table' and (published.err or tostring(published))
                         or tostring(published))
  else
    if dropped == 1 then
      codes[r] = 'd'
    elseif finalizing == 1 then
      codes[r] = 'f'
    else
      codes[r] = tostring(published)
    end
    for _, stream in ipairs(skip) do
      table.insert(skipped, r)
      table.insert(skipped, stream)
    end
  end
end
return {table.concat(codes), skipped, errors}
