"""The ``batchinfer`` command line: the click group, daemon commands, ``run`` and its embedded Redis,
``top``, ``doctor``, progress bars."""
