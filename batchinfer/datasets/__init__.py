"""Tabular datasets in, for pipelines: where the rows of a job come from and how they map onto requests.

A dataset is a folder of Hive partitions, a glob, a list of files or one file (Parquet, CSV, JSON
lines), on a local disk or an object store (``s3://``, ``gs://``, ...), or data already in memory (a
pyarrow Table or Dataset, a pandas or polars DataFrame). :mod:`~batchinfer.datasets.uris` resolves
locations to pyarrow file systems and words store failures, :mod:`~batchinfer.datasets.filters` parses
``--where`` / ``--partition`` filters, :mod:`~batchinfer.datasets.source` lists and scans a dataset in
bounded record batches with each row's number in its file; the other modules turn rows into request
bodies, keep input columns beside the results and record which outputs cover which inputs.

Queue side: this package imports only :mod:`batchinfer.protocol`, :mod:`batchinfer.config`, the
standard library, pyarrow and jinja2.
"""
