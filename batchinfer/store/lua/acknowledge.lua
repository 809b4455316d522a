-- Acknowledge an applied job control entry (op open / close / cancel) on its reply_to stream.
--
-- KEYS[1] the op's reply_to stream (under {p}:reply:)
-- ARGV[1] the acknowledgement row (JSON)
-- ARGV[2] TTL (seconds) of a reply stream after its last row
-- Returns 1 when written, 0 when the key holds another type than a stream (left alone).
if deliver_row(KEYS[1], ARGV[1], ARGV[2]) then
  return 1
end
return 0
