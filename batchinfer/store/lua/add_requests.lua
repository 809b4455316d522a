-- Add a chunk of one job's request entries to the intake stream: one XADD per entry, in order,
-- each exactly the entry a producer XADDs itself (docs/protocol.md, "Jobs"): fields
-- `v <v> body <body> job <job> idx <idx> line <line>`, in that order. One call replaces a
-- pipeline of XADDs: Redis, not the client, builds the commands (the client's hot loop), and
-- the chunk travels as four arguments, not three per entry.
--
-- KEYS[1] the intake stream ({p}:requests)
-- ARGV[1] the protocol version (`v`), ARGV[2] the job id
-- ARGV[3] per entry its idx, line and body's size in bytes, decimal, single spaces: "0 1 17 1 2 19"
-- ARGV[4] the entries' bodies, one after the other, in the same order
-- Returns the number of entries added; an error, adding none, when the sizes do not add up to
-- ARGV[4]'s.
local stream, v, job, bodies = KEYS[1], ARGV[1], ARGV[2], ARGV[4]
local idxs, lines, sizes = {}, {}, {}
local total = 0
for idx, line, size in string.gmatch(ARGV[3], '(%d+) (%d+) (%d+)') do
  local n = #idxs + 1
  idxs[n], lines[n], sizes[n] = idx, line, tonumber(size)
  total = total + sizes[n]
end
if total ~= #bodies then
  return redis.error_reply('add_requests: ' .. #idxs .. ' entries of ' .. total .. ' bytes for bodies of '
                           .. #bodies .. ' bytes')
end
local at = 1
for i = 1, #idxs do
  local after = at + sizes[i]
  redis.call('XADD', stream, '*', 'v', v, 'body', string.sub(bodies, at, after - 1), 'job', job,
             'idx', idxs[i], 'line', lines[i])
  at = after
end
return #idxs
