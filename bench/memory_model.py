"""The memory model against measured peaks: `voodoo train` on CPU at three model sizes.

For each size a random Qwen3.5-shaped checkpoint (hybrid Gated DeltaNet + full attention) is saved
to a temp dir with a random tokens file; `voodoo train` runs a few steps in a child process that
reports its own peak RSS (``VmHWM``) at exit, and :func:`voodoo_quant.memory.dry_run.dry_run` predicts
the same run's CPU peak from the config alone. On CPU device memory and host memory are one RAM,
so the prediction compared is :attr:`MemoryPlan.cpu_peak`. Printed: predicted, measured, error.

    python bench/memory_model.py [--sizes 512 768 1024] [--seq_len 256] [--modes lazy lazy,ckpt,q8 eager lazy,search]
                                 [--out bench/results/memory_model.json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MENU = ("Q8_0", "Q4_K", "Q2_K")

_CHILD = """
import resource, runpy, sys
sys.argv = ["voodoo"] + sys.argv[1:]
try:
    runpy.run_module("voodoo_quant.cli.app", run_name="__main__")
except SystemExit as e:
    if e.code not in (0, None):
        raise
finally:
    # VmHWM: this address space's own high-water mark. ru_maxrss would report at least the RSS
    # this bench's process had when it forked the child (Linux keeps it across execve), and this
    # process builds the models in memory.
    hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
    print("PEAK_RSS", int(hwm[0].split()[1]) * 1024 if hwm else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024,
          flush=True)
"""


def make_model(d: Path, hidden: int, layers: int, vocab: int, seq: int) -> Path:
    from qwen35 import save_qwen35, save_tokens

    save_qwen35(d / "model", hidden, layers, vocab, max_positions=4 * seq)
    save_tokens(d / "data", vocab, 8, seq)
    return d


def flags(d: Path, out: Path, seq: int, extra: list[str]) -> list[str]:
    return ["train", "--model", str(d / "model"), "--data_dir", str(d / "data"), "--output_dir", str(out),
            "--candidate_types", *MENU, "--compression_ratio", "0.6", "--seq_len", str(seq), "--batch_size", "1",
            "--max_steps", "2", "--no_warm_start", "--no_polish", "--loss_chunk_size", "128", *extra]


def mode_flags(mode: str) -> list[str]:
    """lazy, ckpt, q8 as named; without `search` the run stops after the bake (no guarantee, no
    search), with it the guarantee and a 4-evaluation search measure on 2 held-aside sequences
    (their own phase after training: memory/phases.py)."""
    return ((["--lazy"] if "lazy" in mode else []) + (["--gradient_checkpointing"] if "ckpt" in mode else [])
            + (["--teacher_quant", "Q8_0"] if "q8" in mode else [])
            + (["--search_sequences", "2", "--search_evals", "4"] if "search" in mode
               else ["--no_guarantee", "--search_evals", "0"]))


def predict(argv: list[str], show: bool = False) -> float:
    from voodoo_quant.cli.tp import parse_train_flags
    from voodoo_quant.memory.dry_run import dry_run

    cfg = parse_train_flags(argv[1:])
    mem = dry_run(cfg).memory
    if show:
        print("\n".join(mem.lines()))
    return mem.cpu_peak


def measure(argv: list[str]) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOODOO_QUANT_WORKERS": "1", "OMP_NUM_THREADS": "2"}
    p = subprocess.run([sys.executable, "-c", _CHILD, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    peak = [ln for ln in p.stdout.splitlines() if ln.startswith("PEAK_RSS")]
    if p.returncode != 0 or not peak:
        raise SystemExit(f"train failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return float(peak[-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[512, 768, 1024], help="hidden sizes")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--modes", nargs="+", default=["lazy", "lazy,ckpt,q8", "eager"],
                    help="comma-joined: lazy (--lazy), ckpt (--gradient_checkpointing), q8 (--teacher_quant Q8_0), "
                         "search (the guarantee and a short search after training)")
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--workdir", type=Path, default=None, help="keep the models here (reused when present)")
    ap.add_argument("--show", action="store_true", help="print every plan's terms")
    a = ap.parse_args()
    rows = []
    with tempfile.TemporaryDirectory(prefix="voodoo-mem-") as tmp:
        work = a.workdir or Path(tmp)
        for h in a.sizes:
            d = work / f"h{h}"
            if not (d / "model" / "config.json").is_file():
                make_model(d, h, a.layers, a.vocab, a.seq_len)
            for mode in a.modes:
                argv = flags(d, Path(tmp) / f"run-h{h}-{mode}", a.seq_len, mode_flags(mode))
                pred = predict(argv, a.show)
                meas = measure(argv)
                err = (pred - meas) / meas
                rows.append({"hidden": h, "layers": a.layers, "mode": mode, "predicted": pred, "measured": meas,
                             "error": err})
                print(f"hidden {h:5} {mode:10} predicted {pred / 1e9:6.2f} GB  measured {meas / 1e9:6.2f} GB  "
                      f"error {err:+.1%}", flush=True)
    worst = max(abs(r["error"]) for r in rows)
    print(f"worst |error|: {worst:.1%}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
