-- Shared prelude of publish.lua and finish_submission.lua (prepended when the scripts load).
--
-- maybe_finalize(job, now): once a job's submission has ended (`total` is set) and every request
-- has a row (completed + failed >= total), the first caller to get here claims the export with
-- HSETNX export_requested_at and returns 1; everyone else gets 0. An in-progress job becomes
-- `finalizing`; a cancelling or expired job keeps its status (the exporter settles it).
local function maybe_finalize(job, now)
  local f = redis.call('HMGET', job, 'total', 'completed', 'failed', 'status')
  local total = tonumber(f[1])
  if total == nil then
    return 0
  end
  local done = (tonumber(f[2]) or 0) + (tonumber(f[3]) or 0)
  if done < total then
    return 0
  end
  if redis.call('HSETNX', job, 'export_requested_at', now) == 0 then
    return 0
  end
  if f[4] == 'in_progress' or f[4] == 'validating' then
    redis.call('HSET', job, 'status', 'finalizing', 'finalizing_at', now)
  end
  return 1
end
