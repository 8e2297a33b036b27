"""Training-mode ablation: which options of ``voodoo train`` are worth what, measured.

Reuses the artifacts of ``bench/quality.py`` (``--base``: data split, de-gridded teacher, F32
reference GGUF, stock imatrix, the teacher's eval log-probs) so every number here sits on the same
held-out text and floor as the main benchmark. Per standard size, one ``voodoo train`` per variant
(same data, seed, menu and calibration), ``voodoo export``, stock ``llama-perplexity`` KLD:

* ``sensitivity``  -- ``--method sensitivity`` (the one-shot knapsack, no training), with polish;
* ``soft-warm``    -- the defaults: soft mixture, warm start, polish;
* ``soft-cold``    -- ``--no_warm_start`` (uniform gates at step 0);
* ``ptqr``         -- ``--ptqr`` (per-token routing), warm start;
* ``st-gumbel``    -- ``--st_gumbel_fraction 0.5``, warm start;
* ``lr0.25`` / ``lr1.0`` -- the defaults at another learning rate;
* ``steps50`` / ``steps100`` -- the defaults trained longer;
* ``*-nopolish``   -- the same run's journal baked again with ``--no_polish`` (``--finalize_from_partial``):
  the polish's worth on exactly the same gates.

Every step skips itself when its output exists: rerun the same command to resume. Writes
``results.json`` and ``results.md`` into ``--out`` after every evaluated file.

    .venv/bin/python bench/ablation.py --base runs/bench --out runs/ablation --sizes 55,70 --seq_len 128
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality as qb  # noqa: E402  (sets sys.path for voodoo_quant too)

from voodoo_quant import fileio  # noqa: E402


@dataclass(frozen=True)
class Variant:
    name: str
    flags: tuple[str, ...] = ()
    steps: int | None = None  # None: the bench's --steps
    nopolish_of: str | None = None  # rebake this variant's journal with --no_polish


VARIANTS = (
    Variant("sensitivity", ("--method", "sensitivity")),
    Variant("sensitivity-nopolish", ("--method", "sensitivity", "--no_polish")),
    Variant("soft-warm"),
    Variant("soft-warm-nopolish", nopolish_of="soft-warm"),
    Variant("soft-cold", ("--no_warm_start",)),
    Variant("soft-cold-nopolish", nopolish_of="soft-cold"),
    Variant("ptqr", ("--ptqr",)),
    Variant("st-gumbel", ("--st_gumbel_fraction", "0.5")),
    Variant("lr0.25", ("--lr", "0.25")),
    Variant("lr1.0", ("--lr", "1.0")),
    Variant("steps50", steps=50),
    Variant("steps100", steps=100),
)
BY_NAME = {v.name: v for v in VARIANTS}


@dataclass
class AblationConfig:
    base: Path
    out: Path
    sizes: tuple[int, ...] = (55, 70)
    steps: int = 25
    seq_len: int = 128
    variants: tuple[str, ...] = tuple(v.name for v in VARIANTS)
    threads: int = 1
    eval_chunks: int = 8


class Ablation:
    def __init__(self, cfg: AblationConfig, command: str):
        self.cfg = cfg
        self.command = command
        settings = json.loads((cfg.base / "settings.json").read_text())
        qcfg = qb.QualityConfig(out=cfg.base, seq_len=settings["seq_len"], calib_chunks=settings["calib_chunks"],
                                ctx=settings["ctx"], steps=settings["steps"], menu=tuple(settings["menu"]),
                                degrid_seed=settings["degrid_seed"], threads=cfg.threads, stock=(qb.FLOOR,),
                                eval_chunks=cfg.eval_chunks)
        if cfg.seq_len > qcfg.seq_len:
            raise SystemExit(f"--seq_len {cfg.seq_len} > the base's sequences ({qcfg.seq_len} tokens)")
        self.q = qb.QualityBench(qcfg, command)
        self.q.timings_path = cfg.out / "timings.json"  # our timings, not the base's
        self.q.timings = json.loads(self.q.timings_path.read_text()) if self.q.timings_path.is_file() else {}
        self.gguf = cfg.out / "gguf"

    def _q_run(self, argv: list[Any], step: str) -> str:
        # the base's runner logs under the base; ours under --out
        saved = self.q.cfg.out
        self.q.cfg.out = self.cfg.out
        try:
            return self.q._run(argv, step)
        finally:
            self.q.cfg.out = saved

    def run_dir(self, v: Variant, size: int) -> Path:
        return self.cfg.out / "runs" / f"{v.name}{size}"

    def file(self, v: Variant, size: int) -> Path:
        return self.gguf / f"{qb.MODEL_NAME}.abl-{v.name}{size}.gguf"

    def train_argv(self, v: Variant, size: int) -> list[Any]:
        q = self.q
        return [q.voodoo, "train", "--model", q.hf, "--data_dir", q.data, "--imatrix", q.imatrix,
                "--compression_ratio", f"{size / 100:.2f}", "--seq_len", self.cfg.seq_len,
                "--max_steps", v.steps or self.cfg.steps, "--candidate_types", ",".join(q.cfg.menu)]

    def make(self, v: Variant, size: int) -> Path:
        run = self.run_dir(v, size)
        if not (run / "assignment.json").is_file():
            self._share_table(run)
            if v.nopolish_of:
                src = self.run_dir(BY_NAME[v.nopolish_of], size)
                if not (src / "assignment.json").is_file():
                    self.make(BY_NAME[v.nopolish_of], size)
                base = BY_NAME[v.nopolish_of]
                argv = self.train_argv(base, size) + [*base.flags, "--no_polish", "--output_dir", run,
                                                      "--finalize_from_partial", src / "partial.pt",
                                                      "--log_file", src / "train_log.jsonl"]
            else:
                argv = self.train_argv(v, size) + [*v.flags, "--output_dir", run]
            self._q_run(argv, f"train-{v.name}{size}")
        f = self.file(v, size)
        if not f.is_file():
            self._q_run([self.q.voodoo, "export", "--model", self.q.hf, "--assignment", run / "assignment.json",
                         "--imatrix", self.q.imatrix, "--output_dir", self.gguf, "--output_name", f.name],
                        f"export-{v.name}{size}")
        return f

    def _share_table(self, run: Path) -> None:
        """The sensitivity table depends on model, menus and calibration tokens, not on the size or
        the variant: compute it once (train checks its key and recomputes on a mismatch)."""
        from voodoo_quant.training.sensitivity import TABLE_NAME

        if (run / TABLE_NAME).is_file():
            return
        for other in sorted((self.cfg.out / "runs").glob(f"*/{TABLE_NAME}")):
            fileio.write_bytes(run / TABLE_NAME, other.read_bytes())
            return

    def row(self, v: Variant, size: int, f: Path, base, info) -> dict[str, Any]:
        r = self.q.eval_file(f, base, info)  # cached under the base's eval dir, keyed by file
        run = self.run_dir(v, size)
        a = json.loads((run / "assignment.json").read_text())
        train_s = self.q.timings.get(f"train-{v.name}{size}")
        return {**r, "variant": v.name, "size_percent": size, "steps": 0 if "sensitivity" in v.name else (v.steps or self.cfg.steps),
                "selected_bytes": a.get("total_bytes"), "train_s": train_s}

    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        q = self.q
        q.make_data()
        q.make_teacher()
        q.make_texts()
        q.make_imatrix()
        q.make_stock()  # the Q8_0 floor (exists in a finished base)
        base, info = q.eval_base()
        floor = q.eval_file(q.stock_file(qb.FLOOR), base, info)
        rows: list[dict[str, Any]] = []
        # Short variants first at every size, the long ones last: an interrupted run has the core table.
        order = sorted(((BY_NAME[n], s) for n in cfg.variants for s in cfg.sizes),
                       key=lambda vs: ((vs[0].steps or cfg.steps), cfg.variants.index(vs[0].name), vs[1]))
        for v, size in order:
            f = self.make(v, size)
            rows.append(self.row(v, size, f, base, info))
            self.write(rows, floor, info)
        return self.write(rows, floor, info)

    def write(self, rows, floor, info) -> dict[str, Any]:
        result = {"command": self.command, "floor": floor, "reference_ppl": info["reference_ppl"],
                  "setup": {"base": str(self.cfg.base), "sizes": list(self.cfg.sizes), "steps": self.cfg.steps,
                            "seq_len": self.cfg.seq_len, "menu": list(self.q.cfg.menu),
                            "eval_chunks": self.q.cfg.eval_chunks, "ctx": self.q.cfg.ctx, "threads": self.cfg.threads},
                  "rows": rows}
        fileio.write_json(self.cfg.out / "results.json", result)
        fileio.write_text(self.cfg.out / "results.md", markdown(result))
        return result


def markdown(result: dict[str, Any]) -> str:
    """One table: a column per size, a row per variant; KLD, MB and excess KLD relative to the defaults'."""
    floor = float(result["floor"]["kld_mean"])
    rows = result["rows"]
    sizes = sorted({r["size_percent"] for r in rows})
    cell = {(r["variant"], r["size_percent"]): r for r in rows}
    names = [v.name for v in VARIANTS if any(r["variant"] == v.name for r in rows)]
    head = "| variant | steps | " + " | ".join(f"V{s} MB | V{s} KLD | V{s} excess vs default" for s in sizes) + " |"
    sep = "|---|---:|" + "---:|---:|---:|" * len(sizes)
    lines = [f"Setup: {json.dumps(result['setup'])}; Q8_0 floor KLD {floor:.4f}.", "",
             "Excess = (KLD − floor) / (KLD of `soft-warm` − floor) at the same size; < 1 is better than the defaults.",
             "", head, sep]
    for n in names:
        steps = next(r["steps"] for r in rows if r["variant"] == n)
        parts = []
        for s in sizes:
            r, d = cell.get((n, s)), cell.get(("soft-warm", s))
            if r is None:
                parts.append("– | – | –")
                continue
            ex = (float(r["kld_mean"]) - floor) / (float(d["kld_mean"]) - floor) if d else None
            parts.append(f"{r['size_bytes'] / 1e6:.2f} | {float(r['kld_mean']):.4f} | " + ("–" if ex is None else f"{ex:.3f}"))
        lines.append(f"| {n} | {steps} | " + " | ".join(parts) + " |")
    lines += ["", f"Reproduce: `{result['command']}`"]
    return "\n".join(lines) + "\n"


def parse(argv: list[str]) -> AblationConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base", type=Path, default=qb.ROOT / "runs" / "bench", help="a bench/quality.py --out")
    ap.add_argument("--out", type=Path, default=qb.ROOT / "runs" / "ablation")
    ap.add_argument("--sizes", default="55,70")
    ap.add_argument("--steps", type=int, default=25, help="steps of every variant but steps50/steps100")
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--variants", default=",".join(v.name for v in VARIANTS))
    ap.add_argument("--threads", type=int, default=1, help="threads of the stock tools")
    ap.add_argument("--eval_chunks", type=int, default=8, help="llama-perplexity chunks (the base's eval is reused when equal)")
    a = ap.parse_args(argv)
    names = tuple(qb._csv(a.variants))
    bad = [n for n in names if n not in BY_NAME]
    if bad:
        raise SystemExit(f"--variants: unknown {', '.join(bad)}; known: {', '.join(BY_NAME)}")
    if not (a.base / "settings.json").is_file():
        raise SystemExit(f"--base {a.base}: no settings.json (run bench/quality.py --out {a.base} first)")
    return AblationConfig(base=a.base, out=a.out, sizes=tuple(int(s) for s in qb._csv(a.sizes)), steps=a.steps,
                          seq_len=a.seq_len, variants=names, threads=a.threads,
                          eval_chunks=a.eval_chunks)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(argv)
    command = shlex.join([".venv/bin/python", "bench/ablation.py", *argv])
    t0 = time.perf_counter()
    result = Ablation(cfg, command).run()
    print(markdown(result))
    print(f"[ablation] {cfg.out / 'results.md'} ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    # one core for the whole sweep by default: the machine has two and work goes on beside it
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    os.environ.setdefault("VOODOO_QUANT_WORKERS", "1")
    main()
