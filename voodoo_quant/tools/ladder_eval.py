"""The ladder's evaluation: every file against the F32 reference in stock ``llama-perplexity``.

The reference's log-probs on the held-out text are computed once (``--kl-divergence-base``) and
kept under ``work/eval``, keyed by the reference, the eval tokens and the settings; each file's
statistics are kept as one JSON row keyed by that base and by the file's own step key, so adding
a size to a ladder evaluates only the new file. Writes ``eval.json`` (the same row fields as
``voodoo eval --output_json``) and the Pareto plot.
"""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import Any

from ..core import fileio
from .evaluate import EvalRow, detokenize, kld_base, kld_file, perplexity_args, plot_pareto
from .manifest import digest

EVAL_NAME = "eval.json"  # the ladder's measurements, in its output dir
PLOT_NAME = "pareto.png"  # and their plot


def _args(ladder) -> list[str]:
    return perplexity_args(ladder.cfg.ctx, ladder.cfg.chunks, ladder.pre.workers)


def evaluate_ladder(ladder, files: list[tuple[Path, str, int | None]]) -> dict[str, Any]:
    """files: (GGUF, "voodoo" | "stock", size or None). Returns the eval.json dict."""
    c = ladder.cfg
    ev = ladder.work / "eval"
    text = ev / "eval_text.txt"
    base_key = digest({"reference": ladder.keys["reference"], "data": ladder.keys["data"], "ctx": c.ctx,
                       "chunks": c.chunks})
    base = ev / f"base-{base_key}.kld"
    info = ev / f"base-{base_key}.json"

    def make_base() -> None:
        detokenize(ladder.data_dir / "eval_tokens.pt", ladder.teacher_hf, text)
        fileio.write_json(info, {"reference_ppl": kld_base(ladder.reference, text, base, _args(ladder))})

    ladder.step("eval-reference", {"base": base_key}, lambda: [base, info, text], make_base)
    ref_ppl = fileio.read_json(info, what="eval base record")["reference_ppl"]

    rows = []
    for f, method, size in files:
        step = f"eval-{f.stem}"
        row_path = ev / "rows" / f"{f.name}.json"
        src_step = f"export-Voodoo{size}" if method == "voodoo" else f"stock-{f.stem.rsplit('.stock-', 1)[-1]}"

        def measure(f=f, row_path=row_path) -> None:
            fileio.write_json(row_path, asdict(kld_file(f, base, _args(ladder))[0]))

        # "v": the row's fields (2: with kld_stderr); a row of an older version is measured again.
        ladder.step(step, {"base": base_key, "file": ladder.keys[src_step], "v": 2}, lambda row_path=row_path: [row_path],
                    measure)
        row = fileio.read_json(row_path, what="eval row")
        rows.append({**row, "file": str(f), "method": method, "size_percent": size})
    result = {
        "reference": {"file": str(ladder.reference), "ppl": ref_ppl},
        "text": str(ladder.data_dir / "eval_tokens.pt"),
        "ctx": c.ctx,
        "chunks": c.chunks,
        "rows": rows,
    }
    out = c.output_dir
    # Rewritten only when the numbers changed: a rerun with nothing to do touches no file.
    if not ((out / EVAL_NAME).is_file() and (out / PLOT_NAME).is_file()
            and fileio.read_json(out / EVAL_NAME, what="eval JSON") == result):
        fileio.write_json(out / EVAL_NAME, result)
        fields = set(EvalRow.__dataclass_fields__)
        plot_pareto([EvalRow(**{k: v for k, v in r.items() if k in fields}) for r in rows], out / PLOT_NAME)
    return result
