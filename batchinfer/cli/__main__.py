"""``python -m batchinfer.cli``: the same CLI as the ``batchinfer`` command, loaded once."""

from batchinfer.cli.main import main

main()
