"""Print a results file as a table: custom_id, status, the output text (truncated), finish_reason,
tokens (the input's, for vectors), the output constraint of a structured-output row and whether
its output completed; the error code for a failed row. ``make demo`` runs it on
demo-out/results.parquet.
An embedding row shows its width and first values instead of text, and each embedding row's
nearest other row by cosine similarity is listed below the table.

    python examples/show_results.py RESULTS.parquet|RESULTS.jsonl [--width 60]
"""

from __future__ import annotations

import argparse

import numpy as np
import pandas as pd


def vector(row: pd.Series) -> np.ndarray | None:
    """The row's (first) embedding, or None: a generation row, a failed row, a file without vectors."""
    value = row.get("embedding")
    if isinstance(value, (list, np.ndarray)) and len(value):
        return np.asarray(value, dtype=np.float32)
    return None


def table(df: pd.DataFrame, width: int) -> str:
    def text(row: pd.Series) -> str:
        if row["status"] != "completed":
            return f"[{row['error_code']}]"
        v = vector(row)
        if v is not None:
            return f"dim {len(v)}: [" + ", ".join(f"{x:.4f}" for x in v[:4]) + ", ...]"
        out = " ".join(str(row["output_text"]).split())  # newlines and runs of spaces as one space
        return out if len(out) <= width else out[: width - 3] + "..."

    columns = {
        "custom_id": df["custom_id"].fillna("").astype(str),
        "status": df["status"],
        "output": df.apply(text, axis=1),
        "finish": df["finish_reason"].fillna(""),
        "tokens": df["completion_tokens"].fillna(0).astype(int),
    }
    if "structured" in df.columns and df["structured"].notna().any():  # constrained rows: kind, completed?
        columns["constraint"] = [
            "" if pd.isna(kind) else f"{kind} ({'complete' if done else 'cut short'})"
            for kind, done in zip(df["structured"], df["structured_complete"], strict=True)]
    if "embedding" in df.columns:  # vectors: the tokens embedded; nothing is generated or finished
        del columns["finish"]
        columns["tokens"] = df["prompt_tokens"].fillna(0).astype(int)
    view = pd.DataFrame(columns)
    widths = {c: max(len(c), *(len(str(v)) for v in view[c])) for c in view.columns}
    lines = ["  ".join(c.ljust(widths[c]) for c in view.columns)]
    lines += ["  ".join(str(v).ljust(widths[c]) for c, v in row.items()) for _, row in view.iterrows()]
    return "\n".join(line.rstrip() for line in lines)


def neighbours(df: pd.DataFrame) -> str:
    """Each embedding row's nearest other embedding row (same width) by cosine similarity."""
    found = [(str(row["custom_id"]), v) for _, row in df.iterrows() if (v := vector(row)) is not None]
    out = []
    for name, v in found:
        others = [(float(v @ w / (np.linalg.norm(v) * np.linalg.norm(w) or 1.0)), other)
                  for other, w in found if other != name and len(w) == len(v)]
        if others:
            score, best = max(others)
            out.append(f"{name:<20} nearest {best:<20} cosine {score:.3f}")
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("file")
    ap.add_argument("--width", type=int, default=60, help="truncate the output text to this many characters")
    args = ap.parse_args()
    df = pd.read_json(args.file, lines=True) if args.file.endswith(".jsonl") else pd.read_parquet(args.file)
    print(table(df, args.width))
    near = neighbours(df)
    if near:
        print()
        print(near)


if __name__ == "__main__":
    main()
