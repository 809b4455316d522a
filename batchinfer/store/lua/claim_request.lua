-- Claim a client_request_id for a request at intake (the idempotency check), atomically with the
-- request's redelivery hash, so that a later retry can be answered with this request's row.
--
-- KEYS[1] idempotency key {p}:idempotency:<client_request_id>
-- KEYS[2] redelivery hash {p}:redelivery:<request_id> of this entry's request
-- ARGV[1] request id
-- ARGV[2] TTL (seconds) of the claim
-- ARGV[3] this entry's reply_to ('' for none)
-- Returns the request id that holds the claim: ARGV[1] when this entry is the first (or a re-read
-- of it after a crash), else the first request's id (this entry is a duplicate).
local first = redis.call('GET', KEYS[1])
if not first then
  redis.call('SET', KEYS[1], ARGV[1], 'EX', ARGV[2])
  first = ARGV[1]
end
if first == ARGV[1] and redis.call('EXISTS', KEYS[2]) == 0 then
  redis.call('HSET', KEYS[2], 'reply_to', ARGV[3])
  local ttl = redis.call('TTL', KEYS[1])
  if ttl <= 0 then ttl = tonumber(ARGV[2]) end
  redis.call('EXPIRE', KEYS[2], ttl)  -- the hash lives exactly as long as the claim
end
return first
