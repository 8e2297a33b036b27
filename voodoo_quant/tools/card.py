"""The ladder's model card: ``<output_dir>/README.md``, ready for a model hub.

YAML front matter (base_model, license from the source, tags), one table row per Voodoo file
(size, bits per weight, PPL, mean and p99 KLD against the reference, and the same numbers of the
nearest stock recipes below and above it in size), the stock rows, the Pareto plot, how to run
each file in llama.cpp, what wrote each file (the method the selection kept, and whether its
bytes are error-compensated: only an uncompensated file's bytes are stock llama-quantize's),
and how the ladder was made. Every number comes from ``eval.json``
(written in the same run), printed with fixed precision so that a reader — or a test — can check
the card against it.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import fileio, ggml
from ..core.errors import CorruptFileError
from ..selection.assignment import Assignment
from ..training.provenance import compensated_tensors
from .data import META_NAME

CARD_NAME = "README.md"  # the model card, in the ladder's output dir
TAGS = ("gguf", "quantized", "llama.cpp", "imatrix", "voodoo_quant")


def _mb(n: int | None) -> str:
    return "" if n is None else f"{n / 1e6:.2f}"


ROW_HEAD = ["file", "MB", "bpw", "PPL", "KLD mean", "± s.e.", "KLD p99"]


def fmt_row(r: dict[str, Any]) -> list[str]:
    """`ROW_HEAD`'s cells: the card's number formats (tests parse them back). The standard error
    of the mean KLD over the eval chunks is "—" where the chunks cannot resolve it."""
    se = r.get("kld_stderr")
    return [r["name"], _mb(r["size_bytes"]), f"{r['bpw']:.3f}", f"{r['ppl']:.4f}", f"{r['kld_mean']:.6f}",
            "—" if se is None else f"{se:.6f}", f"{r['kld_p99']:.6f}"]


def nearest_stock(row: dict[str, Any], stock: list[dict[str, Any]]) -> tuple[dict | None, dict | None]:
    """The stock rows just below and just above `row` in file size (either may be missing)."""
    below = [s for s in stock if s["size_bytes"] <= row["size_bytes"]]
    above = [s for s in stock if s["size_bytes"] > row["size_bytes"]]
    return (max(below, key=lambda s: s["size_bytes"]) if below else None,
            min(above, key=lambda s: s["size_bytes"]) if above else None)


def _stock_cell(s: dict[str, Any] | None) -> str:
    if s is None:
        return "—"
    return f"{s['name']} ({_mb(s['size_bytes'])} MB): KLD {s['kld_mean']:.6f} / p99 {s['kld_p99']:.6f}, PPL {s['ppl']:.4f}"


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    out = ["| " + " | ".join(head) + " |", "|" + "|".join("---:" if i else "---" for i in range(len(head))) + "|"]
    return out + ["| " + " | ".join(r) + " |" for r in rows]


def _yaml_str(v: str) -> str:
    return json.dumps(v)  # a JSON string is a valid YAML scalar, quotes and colons included


def tool_version() -> str:
    import importlib.metadata as md

    try:
        return md.version("voodoo_quant")
    except md.PackageNotFoundError:
        return "unknown"


def render(ladder, files: dict[int, Path], result: dict[str, Any] | None) -> str:
    c, pre = ladder.cfg, ladder.pre
    name = c.model_name
    lic = c.license or pre.license or "other"
    base = c.base_model or pre.base_model or name
    lines = ["---", f"base_model: {_yaml_str(base)}", f"license: {_yaml_str(lic)}", "tags:"]
    lines += [f"- {t}" for t in TAGS]
    lines += ["quantized_by: voodoo_quant", "---", "", f"# {name}: Voodoo GGUF ladder", ""]
    made = {size: made_by(ladder, size) for size in files}
    lines += [f"{len(files)} GGUF file(s) of `{base}`, each at a standard Voodoo size (a percent of the bytes the "
              "quantizable tensors take at uniform Q8_0), with a per-tensor llama.cpp type chosen by voodoo_quant "
              "under that size budget (which method wrote each file is under \"How each file was made\"). Every "
              "file is a stock GGUF: any llama.cpp build runs it.", ""]
    meta = data_meta(ladder.data_dir / META_NAME)
    if result is not None:
        rows = result["rows"]
        ours = [r for r in rows if r["method"] == "voodoo"]
        stock = sorted((r for r in rows if r["method"] == "stock"), key=lambda r: r["size_bytes"])
        lines += ["## Files", "",
                  f"Measured with stock `llama-perplexity --kl-divergence` against the F32 reference (PPL "
                  f"{result['reference']['ppl']:.4f}) on held-out text ({meta['eval']['sequences']} × "
                  f"{meta['seq_len']} tokens, `-c {result['ctx']}`"
                  + (f", {result['chunks']} chunks" if result["chunks"] else "") + "). Stock recipes are "
                  "`llama-quantize --imatrix` files made from the same reference and imatrix. ± s.e. is the "
                  "standard error of the mean KLD over the text's chunks: a difference between two files "
                  "smaller than about twice it is noise.", ""]
        head = ROW_HEAD + ["nearest stock below", "nearest stock above"]
        body = []
        for r in ours:
            lo, hi = nearest_stock(r, stock)
            body.append(fmt_row(r) + [_stock_cell(lo), _stock_cell(hi)])
        lines += _table(head, body) + ["", "Stock recipes (same reference, same imatrix):", ""]
        lines += _table(ROW_HEAD, [fmt_row(r) for r in stock])
        lines += ["", "![mean KLD against file size](pareto.png)", ""]
    else:
        lines += ["## Files", "", "| file | MB |", "|---|---:|"]
        lines += [f"| {p.name} | {_mb(p.stat().st_size)} |" for p in files.values()] + ["", "(not evaluated: `--no_eval`)", ""]
    first = next(iter(files.values())).name if files else f"{name}.gguf"
    lines += ["## Run it", "", "With any llama.cpp build (`llama-cli`, `llama-server`, `llama-completion`):", "", "```bash"]
    lines += [f"llama-cli -m {p.name} -p \"Once upon a time\" -n 64" for p in files.values()]
    compensated = [size for size, m in made.items() if m.compensated]
    lines += [f"llama-server -m {first} --port 8080", "```", "",
              "Each GGUF has its tensor-type file beside it (`<file>.tensor-types.txt`, lines `^name$=type`). "
              "Stock `llama-quantize` given that file and the imatrix writes the same type for every tensor "
              "from an F32 GGUF of the same weights"
              + (", and the same bytes:" if not compensated else
                 f"; the bytes are the same only for files made without error compensation (here: "
                 f"{', '.join(f'Voodoo{s}' for s in files if s not in compensated) or 'none'}). Error "
                 "compensation hands the quantizer weights adjusted so that each block's rounding error is "
                 "absorbed by the columns after it, which stock `llama-quantize` does not do; "
                 "`voodoo export` writes those bytes again from the run's assignment:"),
              "", "```bash",
              f"llama-quantize --imatrix imatrix.gguf --tensor-type-file {Path(first).stem}.tensor-types.txt "
              f"{name}.F32.gguf {name}.same-types.gguf Q8_0", "```", ""]
    lines += ["## How each file was made", ""]
    lines += [f"- {files[size].name}: {m.describe()}" for size, m in made.items()] + [""]
    menus = c.menus
    tr = ladder.cfg.train_config(c.sizes[0], ladder.teacher_hf)
    texts = "; ".join(f"`{Path(p).name}` (sha256 {h[:12]}…)" for p, h in pre.text_hashes[:8])
    more = f" and {len(pre.text_hashes) - 8} more files" if len(pre.text_hashes) > 8 else ""
    lines += ["## How it was made", "",
              f"- tool: voodoo_quant {tool_version()}, libggml-base {ggml.lib().version} (commit {ggml.lib().commit}); "
              "every quantized byte comes from that library's own quantizer",
              f"- source: `{Path(c.model).name}` (sha256 {pre.source_sha[:16]}…)"
              + (f", de-gridded with seed {c.degrid_seed}" if c.degrid_seed is not None else ""),
              f"- calibration text: {texts}{more}; split by document ({meta['train']['documents']} train, "
              f"{meta['eval']['documents']} held-out documents), {meta['train']['sequences']} train sequences of "
              f"{meta['seq_len']} tokens",
              f"- imatrix: `imatrix.gguf`, computed by `voodoo imatrix` on the first {c.calib_sequences} train "
              "sequences (mean x² per input column, the format stock `llama-quantize --imatrix` reads)",
              f"- menus: default {' '.join(menus.candidate_types)}"
              + (f"; attention {' '.join(menus.attention_candidates)}" if menus.attention_candidates else "")
              + (f"; other {' '.join(menus.non_attention_candidates)}" if menus.non_attention_candidates else "")
              + " (each through llama.cpp's fallback for the tensor's row length"
              + ("; where that collapses a menu, filled with the row's other types in its size range)" if tr.fill_menus else ")"),
              f"- training per size: {tr.max_steps} steps of {tr.batch_size} × {tr.seq_len} tokens, lr {tr.lr}, "
              f"τ {tr.tau_start}→{tr.tau_end}, KL weight {tr.distill_weight}, size tolerance ±{tr.size_tolerance:.0%}, "
              f"seed {tr.seed}, warm start {'on' if tr.warm_start else 'off'}, polish {'on' if tr.polish else 'off'}, "
              f"{tr.device} {tr.dtype}" + (" (lazy candidates)" if tr.lazy else ""),
              f"- sizes: {', '.join(f'Voodoo{s}' for s in c.sizes)} (of {pre.q8_bytes / 1e6:.2f} MB at uniform Q8_0; "
              f"reachable with these menus: {100 * pre.min_bytes / pre.q8_bytes:.1f}–{100 * pre.max_bytes / pre.q8_bytes:.1f} %)",
              "", "Reproduce:", "", "```bash", command_line(c), "```", ""]
    return "\n".join(lines)


@dataclass(frozen=True)
class MadeBy:
    """What wrote one file of the ladder, from its run's assignment: the candidate the selection
    kept (``meta.guarantee.winner``; without a guarantee, the method), how many it measured, and the
    error compensation of its candidates."""

    winner: str
    measured: int
    compensation: dict[str, Any] | None

    @property
    def compensated(self) -> bool:
        return bool(self.compensation) and self.compensation.get("method", "none") != "none"

    def describe(self) -> str:
        w = self.winner
        what = ("the trained gates" if w == "gates" else
                f"the Fisher-priced knapsack{w[len('knapsack'):]}" if w.startswith("knapsack") else
                f"{w} (one type on every selectable tensor)" if w.startswith("uniform ") else
                f"llama-quantize's {w[len('stock '):]} recipe (its per-tensor types)" if w.startswith("stock ") else w)
        out = (f"written by {what}, the lowest KL of the {self.measured} assignments measured on held-aside training "
               "sequences" if self.measured > 1 else f"written by {what}")
        c = self.compensation
        return out + (f"; error compensation {c['method']} (damping {c.get('damp')})" if self.compensated
                      else "; no error compensation (the bytes are stock llama-quantize's for these types)")


def made_by(ladder, size: int) -> MadeBy:
    """The :class:`MadeBy` of the ladder's Voodoo`size` file (its run's assignment.json)."""
    return read_made_by(ladder.work / "runs" / f"Voodoo{size}" / "assignment.json")


def read_made_by(path: Path) -> MadeBy:
    """The :class:`MadeBy` an assignment file records, read and checked by ``Assignment.load``: a
    damaged file is one :class:`CorruptFileError` naming it. Its compensation is the run's only
    when some selected tensor's bytes are compensated (``provenance.compensated_tensors``), as
    export's ``voodoo.error_compensation`` key: otherwise the file holds stock llama-quantize's bytes."""
    asg = Assignment.load(path)
    comp = asg.compensation if compensated_tensors(asg) else None
    meta = asg.meta
    try:
        g = meta.get("guarantee")
        if g:
            return MadeBy(str(g["winner"]), len(g.get("candidates", [])), comp)
        return MadeBy("gates" if meta.get("method", "gates") == "gates" else "knapsack", 1, comp)
    except (AttributeError, KeyError, TypeError) as e:
        raise CorruptFileError(f"{path}: malformed assignment meta ({type(e).__name__}: {e})") from None


# the counts of the data step's meta.json the card prints
_META_COUNTS = (("seq_len",), ("train", "documents"), ("train", "sequences"), ("eval", "documents"),
                ("eval", "sequences"))


def data_meta(path: Path) -> dict[str, Any]:
    """The data step's meta.json (``tools/data.py``), with every count the card prints checked: a
    damaged file is one :class:`CorruptFileError` naming it, not a KeyError halfway through the card."""
    meta = fileio.read_json(path, what="data meta")
    for keys in _META_COUNTS:
        v: Any = meta
        for k in keys:
            v = v.get(k) if isinstance(v, dict) else None
        if not isinstance(v, int) or isinstance(v, bool):
            raise CorruptFileError(f"data meta {path} is malformed: {'.'.join(keys)} is {v!r}, expected a count")
    return meta


def command_line(c) -> str:
    import shlex

    argv = ["voodoo", "quantize", "--model", str(c.model), "--text", *c.texts, "--sizes", *map(str, c.sizes),
            "--output_dir", str(c.output_dir), "--model_name", c.model_name, "--seq_len", str(c.seq_len),
            "--max_steps", str(c.max_steps), "--seed", str(c.seed), "--calib_sequences", str(c.calib_sequences)]
    if c.eval_fraction != 0.1:
        argv += ["--eval_fraction", str(c.eval_fraction)]
    if c.glob != "*":
        argv += ["--glob", c.glob]
    if c.degrid_seed is not None:
        argv += ["--degrid_seed", str(c.degrid_seed)]
    if c.candidate_types:
        argv += ["--candidate_types", *c.candidate_types]
    if not c.eval:
        argv += ["--no_eval"]
    else:
        argv += ["--stock", *c.stock]
        if c.chunks is not None:
            argv += ["--chunks", str(c.chunks)]
    return shlex.join(argv)


def write_card(ladder, files: dict[int, Path], result: dict[str, Any] | None) -> Path:
    path = ladder.cfg.output_dir / CARD_NAME
    text = render(ladder, files, result)
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        fileio.write_text(path, text)
    return path
