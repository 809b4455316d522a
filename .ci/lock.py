"""The dependency lock (requirements.lock): write it from a venv, or say how a venv differs from it.

    python .ci/lock.py write VENV_PYTHON requirements.lock   # `make lock`
    python .ci/lock.py diff VENV_PYTHON requirements.lock    # `make drift`, after test-latest

The lock is a pip constraints file: one ``name==version`` line for every distribution the dev
venv holds (pip and setuptools included, since the editable install builds without isolation),
except batchinfer itself and those the Makefile pins on its own line (torch: TORCH_PIN chooses the
CPU build where there is no GPU). Constraints install nothing by themselves, so one lock serves
``make setup`` and ``make setup-dev`` alike.
"""

from __future__ import annotations

import datetime
import platform
import re
import subprocess
import sys
from pathlib import Path

# Pinned elsewhere: TORCH_PIN in the Makefile (the CPU build here, CUDA's on a GPU machine).
NOT_LOCKED = {"batchinfer", "torch"}


def _key(name: str) -> str:
    """PEP 503's normalised name: `Jinja2`, `jinja2` and `typing_extensions` compare as pip does."""
    return re.sub(r"[-_.]+", "-", name).lower()


def installed(python: str) -> dict[str, str]:
    """{normalised name: version} of every distribution in the venv of ``python``."""
    out = subprocess.run([python, "-m", "pip", "list", "--format=freeze", "--exclude-editable"],
                         capture_output=True, text=True, check=True).stdout
    pins = {}
    for line in out.splitlines():
        name, sep, version = line.partition("==")
        if sep:
            pins[_key(name)] = version
    return {k: v for k, v in pins.items() if k not in NOT_LOCKED}


def read_lock(path: Path) -> dict[str, str]:
    pins = {}
    for n, raw in enumerate(path.read_text().splitlines(), 1):
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        name, sep, version = line.partition("==")
        if not sep:
            raise SystemExit(f"{path}:{n}: not a name==version line: {raw!r}")
        pins[_key(name.strip())] = version.strip()
    return pins


def write(python: str, path: Path) -> None:
    pins = installed(python)
    py = subprocess.run([python, "-c", "import platform; print(platform.python_version())"],
                        capture_output=True, text=True, check=True).stdout.strip()
    header = [
        "# The exact versions of the dev and CI environment: pip constraints (`pip install -c`).",
        f"# Written by `make lock` on {datetime.date.today()} from Python {py} on "
        f"{platform.system()} {platform.machine()}; do not edit by hand.",
        "# torch is not here: the Makefile's TORCH_PIN installs it (the CPU build without a GPU).",
    ]
    path.write_text("\n".join([*header, *(f"{k}=={v}" for k, v in sorted(pins.items()))]) + "\n")
    print(f"{path}: {len(pins)} pins")


def diff(python: str, path: Path) -> int:
    """Print each distribution whose version differs from the lock; the number of them."""
    now, locked = installed(python), read_lock(path)
    changed = [(k, locked.get(k, "-"), now.get(k, "-")) for k in sorted(now.keys() | locked.keys())
               if locked.get(k) != now.get(k)]
    if not changed:
        print(f"drift: none, the venv holds exactly {path}'s versions")
    else:
        print(f"drift: {len(changed)} distribution(s) differ from {path} (lock -> this venv):")
        for name, old, new in changed:
            print(f"  {name}: {old} -> {new}")
    return len(changed)


def main(argv: list[str]) -> int:
    if len(argv) != 3 or argv[0] not in ("write", "diff"):
        print(__doc__, file=sys.stderr)
        return 2
    verb, python, path = argv[0], argv[1], Path(argv[2])
    if verb == "write":
        write(python, path)
    else:
        diff(python, path)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
