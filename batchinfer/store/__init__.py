"""What lives in Redis besides the streams' traffic: job records, model and worker registrations,
exactly-once publication (Lua scripts in ``lua/``) and read-only views of queue state."""
