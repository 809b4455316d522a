"""The Python client of the queue: :class:`~batchinfer.client.client.Client` and its input readers."""
