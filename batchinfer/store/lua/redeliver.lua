-- Answer a retry (same client_request_id, dropped as a duplicate) on its own reply stream: with the
-- first request's row now if it is published, else when it is (publish.lua drains the hash). Each
-- reply stream gets the row once: the first request's own reply_to, and any stream already
-- delivered to or waiting, get nothing more.
--
-- KEYS[1] redelivery hash {p}:redelivery:<first request id>
-- KEYS[2] the retry's reply_to stream
-- ARGV[1] TTL (seconds) of a reply stream after its last row
-- Returns 'delivered', 'waiting', 'same' (already the first request's reply stream),
-- 'already' (already delivered or waiting), 'wrongtype' (KEYS[2] is not a stream), or 'unknown'
-- (no hash: the first request was accepted before redelivery existed, or its claim expired).
if redis.call('EXISTS', KEYS[1]) == 0 then
  return 'unknown'
end
if redis.call('HGET', KEYS[1], 'reply_to') == KEYS[2] then
  return 'same'
end
local field = 'to:' .. KEYS[2]
if redis.call('HEXISTS', KEYS[1], field) == 1 then
  return 'already'
end
local row = redis.call('HGET', KEYS[1], 'row')
if not row then
  redis.call('HSET', KEYS[1], field, '0')
  return 'waiting'
end
if not deliver_row(KEYS[2], row, ARGV[1]) then
  return 'wrongtype'
end
redis.call('HSET', KEYS[1], field, '1')
return 'delivered'
