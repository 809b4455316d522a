"""The HTTP API (``batchinfer api``): OpenAI Files and Batches, Anthropic Message Batches and the
synchronous endpoints, served from the same Redis protocol as every other producer (docs/api.md).

It holds no state of its own: records live in Redis and bytes in the file store, so any number of
replicas behind a load balancer serve the same batches; it never calls the engine.
"""
