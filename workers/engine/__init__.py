"""The engine: requests and their tokens owed, the step scheduler, paged KV blocks, the model runner
and the sampler. :class:`~batchinfer.workers.engine.engine.Engine` drives one step at a time."""
