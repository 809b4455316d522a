"""What the CLI tests share: invoking the click group in process, and a small prompts file."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner, Result

from batchinfer.cli.main import cli


def invoke(*args: str, code: int = 0) -> Result:
    """``batchinfer ARGS`` in process; asserts the exit code (0 unless ``code`` says otherwise)."""
    result = CliRunner().invoke(cli, list(args), catch_exceptions=False)
    assert result.exit_code == code, (result.exit_code, result.output)
    return result


def prompts(tmp_path: Path, n: int = 3) -> Path:
    """A JSONL file of ``n`` plain prompt lines (custom ids c0.., prompts p0..)."""
    f = tmp_path / "in.jsonl"
    f.write_text("".join(json.dumps({"custom_id": f"c{i}", "prompt": f"p{i}"}) + "\n" for i in range(n)))
    return f
