-- Remove a batch entry no live worker holds (batchinfer.scheduler.accounting.Settler), once every request in it
-- has its row, only if it is still where the scheduler saw it: a worker that read it meanwhile
-- keeps it (it finds the rows published, skips them and acks the entry itself).
--
-- KEYS[1] batches stream {p}:batches:<model>
-- ARGV[1] group (workers)
-- ARGV[2] entry id
-- ARGV[3] the consumer it was pending for when seen (a worker no longer live), or '' for an
--         entry no consumer had read (after the group's last-delivered-id)
-- Returns 1 when the entry was removed (XACK + XDEL, or XDEL), else 0.
local function older_or_same(a, b)  -- stream ids 'ms-seq'
  local ams, aseq = string.match(a, '^(%d+)-(%d+)$')
  local bms, bseq = string.match(b, '^(%d+)-(%d+)$')
  ams, aseq, bms, bseq = tonumber(ams), tonumber(aseq), tonumber(bms), tonumber(bseq)
  return ams < bms or (ams == bms and aseq <= bseq)
end

local pending = redis.pcall('XPENDING', KEYS[1], ARGV[1], ARGV[2], ARGV[2], 1)
local grouped = type(pending) == 'table' and pending.err == nil
local owner = grouped and pending[1] and pending[1][2] or nil
if ARGV[3] ~= '' then
  if owner ~= ARGV[3] then return 0 end  -- claimed since (a lease, a worker restarted under the name)
  redis.call('XACK', KEYS[1], ARGV[1], ARGV[2])
  return redis.call('XDEL', KEYS[1], ARGV[2])
end
if owner then return 0 end  -- a worker read it meanwhile
if grouped then
  for _, group in ipairs(redis.call('XINFO', 'GROUPS', KEYS[1])) do
    local name, last = nil, nil
    for i = 1, #group, 2 do
      if group[i] == 'name' then name = group[i + 1] elseif group[i] == 'last-delivered-id' then last = group[i + 1] end
    end
    if name == ARGV[1] and last and older_or_same(ARGV[2], last) then return 0 end  -- delivered, acked
  end
end
return redis.call('XDEL', KEYS[1], ARGV[2])
