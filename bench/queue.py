"""``python bench/queue.py``: the queue benchmarks (issue 4's name for them); the code is in queue_bench.py.

Running a file named ``queue.py`` puts its folder first on ``sys.path``, where it would shadow the
standard library's ``queue`` module for everything imported afterwards (redis-py, rq, torch...).
So this entry point takes its folder off ``sys.path`` before anything else is imported, then runs
``queue_bench.py`` as ``__main__`` with the same arguments.
"""

import os
import runpy
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or os.curdir) != HERE]
runpy.run_path(os.path.join(HERE, "queue_bench.py"), run_name="__main__")
