"""The worker service: feeds the inference library (batchinfer.workers) from Redis, publishes its rows."""
