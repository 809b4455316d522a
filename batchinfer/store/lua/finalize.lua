-- Shared prelude of publish.lua and finish_submission.lua (prepended when the scripts load).
--
-- maybe_finalize(job, now): once a job's submission has ended (`total` is set) and every request
-- has a row (completed + failed + cancelled + expired >= total; a record written before cancelled
-- and expired rows were counted apart lacks those two fields, which then count 0), the first
-- caller to get here claims the export with HSETNX export_requested_at and returns 1; everyone
-- else gets 0. An in-progress job becomes `finalizing`, or `expired` when its completion window
-- ended before its last row (OpenAI's rule: a batch not done within its window is expired, with
-- its partial results); a cancelling or expired job keeps its status (the exporter settles it).
local function maybe_finalize(job, now)
  local f = redis.call('HMGET', job, 'total', 'status', 'expires_at',
                       'completed', 'failed', 'cancelled', 'expired')
  local total = tonumber(f[1])
  if total == nil then
    return 0
  end
  local done = 0
  for i = 4, 7 do done = done + (tonumber(f[i]) or 0) end
  if done < total then
    return 0
  end
  if redis.call('HSETNX', job, 'export_requested_at', now) == 0 then
    return 0
  end
  if f[2] == 'in_progress' or f[2] == 'validating' then
    local expires = tonumber(f[3])
    if expires ~= nil and tonumber(now) > expires then
      redis.call('HSET', job, 'status', 'expired', 'expired_at', now)
    else
      redis.call('HSET', job, 'status', 'finalizing', 'finalizing_at', now)
    end
  end
  return 1
end
