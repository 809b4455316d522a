"""Print a results file as a table: custom_id, status, the output text (truncated), finish_reason,
tokens; the error code for a failed row. ``make demo`` runs it on demo-out/results.parquet.

    python examples/show_results.py RESULTS.parquet|RESULTS.jsonl [--width 60]
"""

from __future__ import annotations

import argparse

import pandas as pd


def table(df: pd.DataFrame, width: int) -> str:
    def text(row: pd.Series) -> str:
        if row["status"] != "completed":
            return f"[{row['error_code']}]"
        out = " ".join(str(row["output_text"]).split())  # newlines and runs of spaces as one space
        return out if len(out) <= width else out[: width - 3] + "..."

    view = pd.DataFrame({
        "custom_id": df["custom_id"].fillna("").astype(str),
        "status": df["status"],
        "output": df.apply(text, axis=1),
        "finish": df["finish_reason"].fillna(""),
        "tokens": df["completion_tokens"].fillna(0).astype(int),
    })
    widths = {c: max(len(c), *(len(str(v)) for v in view[c])) for c in view.columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in view.columns)]
    lines += ["  ".join(str(v).ljust(widths[c]) for c, v in row.items()) for _, row in view.iterrows()]
    return "\n".join(line.rstrip() for line in lines)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--width", type=int, default=60, help="truncate the output text to this many characters")
    args = ap.parse_args()
    df = pd.read_json(args.file, lines=True) if args.file.endswith(".jsonl") else pd.read_parquet(args.file)
    print(table(df, args.width))


if __name__ == "__main__":
    main()
