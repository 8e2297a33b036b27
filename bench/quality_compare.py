"""Two variants of one benchmark, paired chunk by chunk: the same files (method and size, or stock
and uniform recipe; a trained file's step count and seed: a seed-1 file pairs with a seed-1 file)
measured on the same eval text in two results files of ``bench/quality.py`` (one run each, e.g.
with and without a ``--train_args`` setting, each under its own ``--name``).

Printed as Markdown, per calibration, eval text and file: the mean KLD of each (± its standard
error over chunks), B − A paired over the chunks both scored (± its standard error), and the two
file sizes. A and B must have scored the same chunks of the same text (the eval text's sha256 is
checked).

    .venv/bin/python bench/quality_compare.py docs/results/smollm2-menu-nofill.jsonl \\
        docs/results/smollm2-menu-fill.jsonl

Two methods of one results file pair the same way, file by file at each size: ``--methods A B``
(e.g. ``--methods knapsack-gptq-packed knapsack-gptq`` with the same file twice).
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_report as report  # noqa: E402
import quality_rows as store  # noqa: E402


def key(r: dict) -> tuple:
    """What a file is, apart from the variant: its calibration, eval text, method, size/recipe, and
    a trained file's step count and seed (a knapsack at the default seed has none: None)."""
    what = r.get("recipe") if r["method"] in ("stock", "uniform") else r.get("size")
    return r.get("calib"), r.get("text"), r["method"], what, r.get("steps"), r.get("seed")


def eval_text(r: dict) -> tuple:
    """(sha256, context, chunks) of the eval a row was scored on."""
    e = (r.get("config") or {}).get("eval") or {}
    return e.get("sha256"), e.get("ctx"), e.get("chunks")


def compare(a_rows: list[dict], b_rows: list[dict], methods: tuple[str, str] | None = None) -> list[dict]:
    """One entry per file present in both, in A's order (the latest row of each file). With
    `methods` (A's, B's), A's rows of the first method pair with B's of the second."""
    a_rows, b_rows = report.latest(a_rows), report.latest(b_rows)
    if methods:
        a_rows = [dict(r, method=methods[1]) for r in a_rows if r["method"] == methods[0]]
        b_rows = [r for r in b_rows if r["method"] == methods[1]]
    a = {key(r): r for r in a_rows}
    b = {key(r): r for r in b_rows}
    out = []
    for k, ra in a.items():
        rb = b.get(k)
        if rb is None:
            continue
        if eval_text(ra) != eval_text(rb):
            raise SystemExit(f"{report._label(ra)} on {k[1]}: the two runs scored different eval texts "
                             f"({eval_text(ra)} and {eval_text(rb)})")
        out.append({"key": k, "label": report._label(ra), "a": ra, "b": rb,
                    "paired": report.paired(rb.get("kld_chunks") or [], ra.get("kld_chunks") or [])})
    return out


def markdown(entries: list[dict], a_name: str, b_name: str) -> str:
    lines = [f"A = {a_name}, B = {b_name}", "",
             "| calibration | text | file | MB A | MB B | KLD A | KLD B | B − A, paired |",
             "|---|---|---|---:|---:|---:|---:|---:|"]
    for e in entries:
        ra, rb, p = e["a"], e["b"], e["paired"]
        diff = "—" if p is None else f"{p[0]:+.5f} ± {p[1]:.5f}"
        lines.append(f"| {e['key'][0]} | {e['key'][1]} | {e['label']} | {ra['size_bytes'] / 1e6:.2f} | "
                     f"{rb['size_bytes'] / 1e6:.2f} | {ra['kld_mean']:.5f} ± {ra['kld_stderr']:.5f} | "
                     f"{rb['kld_mean']:.5f} ± {rb['kld_stderr']:.5f} | {diff} |")
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("a", type=Path, help="results JSONL of variant A")
    ap.add_argument("b", type=Path, help="results JSONL of variant B")
    ap.add_argument("--methods", nargs=2, metavar=("A", "B"), default=None,
                    help="pair A's files of method A with B's of method B (e.g. two methods of one file)")
    x = ap.parse_args(argv)
    methods = tuple(x.methods) if x.methods else None
    entries = compare(store.read_rows(x.a), store.read_rows(x.b), methods)
    if not entries:
        raise SystemExit(f"{x.a} and {x.b} have no file in common")
    names = (f"{x.a.stem} {methods[0]}", f"{x.b.stem} {methods[1]}") if methods else (x.a.stem, x.b.stem)
    print(markdown(entries, *names), end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
