-- Publish many result rows, each exactly once (publish_row, in the publish_row.lua prelude): one
-- call for a worker's rows of one partition, so that a row costs Redis' and the client's work for
-- its own keys and values only, not a command's. Each row is published as publish.lua would.
--
-- KEYS: every key the rows name, each once (a job's guard, results stream and job hash serve all
-- of its rows).
-- ARGV[1] now (ms since the epoch)
-- ARGV[2] TTL (seconds) of a direct request's guard, and of a reply stream after its last row
-- ARGV[3] retention of results:direct: entries older than this id (ms) are trimmed (MINID ~)
-- then per row, in order, two values: its spec, "idx counter g s j d[ r]" (idx -1 for a direct
-- request; the counter to bump; the KEYS positions of its guard, results stream, job hash,
-- redelivery hash and reply_to: publish.lua's KEYS[1..5]), and the row (JSON).
-- Returns {codes, skipped, errors}: codes, one character per row: '0' not published (it already
-- was), '1' published, 'f' published and the job made final (its export is the caller's), 'd'
-- dropped (the job has no record), 'e' failed (the error is in errors); skipped: row number (from
-- 1), stream, ... for reply streams left unwritten (not a stream); errors: row number, message, ...
-- A row that fails (e.g. WRONGTYPE on its guard) fails alone: the rows after it are published.
local now, ttl, minid = ARGV[1], ARGV[2], ARGV[3]
local codes, skipped, errors = {}, {}, {}
for r = 1, (#ARGV - 3) / 2 do
  local spec, row = ARGV[2 + 2 * r], ARGV[3 + 2 * r]
  local idx, counter, g, s, j, d, rt = string.match(spec, '^(%-?%d+) (%S+) (%d+) (%d+) (%d+) (%d+) ?(%d*)$')
  local ok, published, finalizing, skip, dropped
  if not idx then
    ok, published = false, 'malformed row spec: ' .. spec
  else
    local reply_to = rt ~= '' and KEYS[tonumber(rt)]
    ok, published, finalizing, skip, dropped = pcall(publish_row,
      KEYS[tonumber(g)], KEYS[tonumber(s)], KEYS[tonumber(j)], KEYS[tonumber(d)], reply_to,
      tonumber(idx), row, counter, now, ttl, minid)
  end
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
