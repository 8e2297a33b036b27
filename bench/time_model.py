"""The time model of `voodoo train --dry_run` (voodoo_quant/memory/timing.py) against this machine.

Two commands:

``constants``: measures, side by side with the probe's own rates (memory/rates.py), what the
constants of memory/timing.py and rates.DERIVED stand for, on a model with the widths of `--model`
(its config, `--layers` decoder layers, random weights; the checkpoint itself for the read):

Each ``K_*`` is a pass's CPU seconds per flop ÷ the probe's GEMM's CPU seconds per flop (measured
before and after it, on torch's threads): CPU time, not wall time, so that other jobs on the
cores stretch neither side (their wall times moved 4× within one repeat):

- ``K_FORWARD``: a no-grad forward of [1, seq] and [4, seq];
- ``K_FISHER``: training/layerwise.fisher_curvature (a Q8_0 menu: its curvature's dequantization
  taken out), flops of 4 layer + 3 head passes;
- ``K_HESSIANS``: training/layer_hessians.collect_layerwise (arrays consumed, no file), flops of
  its forward and of xᵀx's upper block triangle (timing.hessian_flops);
- ``K_PLAIN_STEP``: a plain forward+backward with weight gradients and a no-grad teacher forward,
  flops of 4 forwards;
- ``LOAD_BYTES_PER_S``: model.modeling.load_model of `--model` (whatever the page cache holds);
- ``DISK_BYTES_PER_S``: 2 GB written through core.fileio (fsync'ed);
- ``CONVERT_BYTES_PER_S``: gguf.converter.convert of `--model` to F32;
- ``CHOL_LARGE``: the one-thread Cholesky rate at n = 8,960 ÷ at the probe's n = 1,024;
- ``GRID_SETUP_S`` and ``DERIVED``: each grid type's setup in a fresh process, and its quantization
  and compensation walk (every sweep) ÷ IQ2_XXS's, the median of `--repeats`.

``run``: the dry run's time plan for the flags after ``--``, then that run in this process with
its stages timed (bench/time_model_run.py), predicted ÷ measured per stage; ``--truncate N`` runs
a copy of ``--model`` cut to its first N decoder layers (real weights and widths, a shorter run).

``compare``: a cost file (docs/results/<model>.cost.jsonl: one line per step, its seconds) against
the time model's prediction for the config it ran with (the dry run's flags after ``--``), per step
as predicted ÷ measured. Train steps are predicted from scratch for the first train step of a
session and method and with its candidates cached and its table and Hessians reused after it (as a
ladder's later sizes find them); eval steps are not predicted (stock llama-perplexity's speed per
type is not probed). The rates are probed now, on this machine: a cost line measured on another
machine (or under other load) differs by that machine's speed, which the ratios show.

    OMP_NUM_THREADS=2 .venv/bin/python bench/time_model.py constants --model $TEACHER --out bench/results/time_model_constants.json
    .venv/bin/python bench/time_model.py compare docs/results/qwen2.5-coder-1.5b.cost.jsonl --session 10b36ead7a3f \\
        -- --model $TEACHER --compression_ratio 0.30 --method sensitivity --error_compensation none --seq_len 512
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

GRID = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ1_S", "IQ1_M", "IQ3_XXS", "IQ3_S")
SWEEPS = ("ruled", "fixed", "packed", "requant")
PARTS = ("k", "load", "disk", "convert", "grid", "derived", "chol")


def _small_model(model_dir: str, layers: int):
    import torch
    import transformers

    from voodoo_quant.model.lazyload import load_config

    cfg = load_config(model_dir)
    cfg.num_hidden_layers = layers
    if getattr(cfg, "layer_types", None):
        cfg.layer_types = cfg.layer_types[:layers]
    torch.manual_seed(0)
    cls = getattr(transformers, cfg.architectures[0])
    return cls(cfg).to(torch.float32).eval()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _cpu(fn) -> float:
    """The process's CPU seconds (all threads) of fn(): what a pass costs whatever else the
    machine runs (its wall time stretches with the load, its CPU time hardly does)."""
    t0 = time.process_time()
    fn()
    return time.process_time() - t0


def constants(args) -> dict:
    import torch

    out: dict = {"model": Path(args.model).name, "layers": args.layers, "seq_len": args.seq_len,
                 "threads": torch.get_num_threads()}
    parts = set(args.only or PARTS)
    if "chol" in parts:
        out["CHOL_LARGE"] = _chol_large(args.repeats)
        print("chol", out["CHOL_LARGE"], flush=True)
    if "k" in parts:
        out.update(_k_constants(args))
    if "load" in parts:
        t = _timed(lambda: __import__("voodoo_quant.model.modeling", fromlist=["load_model"]).load_model(
            args.model, dtype=torch.float32))
        ckpt = sum(f.stat().st_size for f in Path(args.model).glob("*.safetensors"))
        out["LOAD_BYTES_PER_S"] = {"value": ckpt / t, "bytes": ckpt, "seconds": t}
        print("load", out["LOAD_BYTES_PER_S"], flush=True)
    if parts & {"disk", "convert"}:
        out.update(_disk(args, parts))
    if "grid" in parts:
        out["GRID_SETUP_S"] = _grid_setup()
        print("grid setup", out["GRID_SETUP_S"], flush=True)
    if "derived" in parts:
        out["DERIVED"] = _derived(args.repeats)
    return out


def _chol_large(repeats: int) -> dict:
    """The one-thread Cholesky rate at the down projection's width (8,960) ÷ at the probe's (1,024),
    alternating, the median of `repeats` pairs."""
    from voodoo_quant.memory import rates as R

    small, large = [], []
    for _ in range(repeats):
        small.append(R.chol_rate(R.CHOL_N))
        large.append(R.chol_rate(8960))
    return {"value": statistics.median(b / a for a, b in zip(small, large)), "n": 8960,
            "small": small, "large": large}


def _k_constants(args) -> dict:
    import numpy as np
    import torch

    from voodoo_quant.arch import adapter_for
    from voodoo_quant.core import ggml
    from voodoo_quant.memory import rates as R
    from voodoo_quant.memory import timing as tm
    from voodoo_quant.selection.menus import MenuConfig
    from voodoo_quant.student.build import plan_model
    from voodoo_quant.training import layerwise
    from voodoo_quant.training.layer_hessians import collect_layerwise

    out: dict = {}
    T = args.seq_len
    model = _small_model(args.model, args.layers)
    plans = plan_model(model, adapter_for(model.config), MenuConfig(("Q8_0",)))
    shp = tm.model_shapes(model, plans, T)
    text = model.config.get_text_config()

    a, b = torch.randn(128, text.hidden_size), torch.randn(text.hidden_size, text.intermediate_size)

    def gemm() -> float:
        """The probe's GEMM in CPU seconds per flop (best of 3 after a warm-up)."""
        a @ b
        return min(_cpu(lambda: a @ b) for _ in range(3)) / (2.0 * a.shape[0] * a.shape[1] * b.shape[1])

    def k_of(seconds: float, flops: float, per_flop: list[float]) -> float:
        return seconds / flops / statistics.mean(per_flop)

    ids = torch.randint(0, text.vocab_size, (4, T), generator=torch.Generator().manual_seed(0))
    ks = {"K_FORWARD": [], "K_FISHER": [], "K_HESSIANS": [], "K_PLAIN_STEP": []}
    lib = ggml.lib()
    blobs = {p.name: {"Q8_0": lib.quantize(np.ascontiguousarray(p.layout.to_gguf(model.get_parameter(p.name).detach()),
                                                                dtype=np.float32), "Q8_0")} for p in plans}
    for rep in range(args.repeats):
        g0 = gemm()
        with torch.no_grad():
            model(input_ids=ids[:1, :16])
            s1 = _cpu(lambda: model(input_ids=ids[:1]))
            s4 = _cpu(lambda: model(input_ids=ids))
        g1 = gemm()
        ks["K_FORWARD"] += [k_of(s1, T * shp.flops, [g0, g1]), k_of(s4, 4 * T * shp.flops, [g0, g1])]
        weights = {p.name: model.get_parameter(p.name) for p in plans}
        s = _cpu(lambda: layerwise.fisher_curvature(model, plans, ids[:2], lambda p: blobs[p.name], weights))
        curv = _cpu(lambda: R.dequant_rates(["Q8_0"])) / (3 * R.PROBE_ROWS * R.PROBE_N) * sum(tm._numel(p) for p in plans)
        g2 = gemm()
        ks["K_FISHER"].append(k_of(s - curv, 2 * T * (4 * shp.layer_flops + 3 * shp.head_flops), [g1, g2]))
        c = collect_layerwise(model, plans, ids)
        s = _cpu(lambda: [h for _, h in c.arrays])
        g3 = gemm()
        ks["K_HESSIANS"].append(k_of(s, 4 * T * shp.layer_flops + tm.hessian_flops(4 * T, shp.inputs), [g2, g3]))
        teacher = _small_model(args.model, args.layers)

        def plain_step():
            with torch.no_grad():
                t = teacher(input_ids=ids[:1]).logits
            logits = model(input_ids=ids[:1]).logits
            loss = torch.nn.functional.kl_div(logits.log_softmax(-1), t.log_softmax(-1), log_target=True)
            loss.backward()
        for p in model.parameters():
            p.requires_grad_(True)
        s = _cpu(plain_step)
        for p in model.parameters():
            p.requires_grad_(False)
            p.grad = None
        del teacher
        g4 = gemm()
        ks["K_PLAIN_STEP"].append(k_of(s, 4 * T * shp.flops, [g3, g4]))
        print(rep, {k: round(v[-1], 3) for k, v in ks.items()},
              f"GEMM {1 / g0 / 1e9:.1f}..{1 / g4 / 1e9:.1f} GFLOP per CPU second", flush=True)
    out.update({k: {"median": statistics.median(v), "values": v} for k, v in ks.items()})
    return out


def _disk(args, parts) -> dict:
    import numpy as np

    from voodoo_quant.core import fileio

    out = {}
    with tempfile.TemporaryDirectory(dir=args.tmp) as d:
        blob = np.random.default_rng(0).integers(0, 255, 64 << 20, dtype=np.uint8)

        def write(tmp: Path) -> None:
            with open(tmp, "wb") as fh:
                for _ in range(32):
                    fh.write(memoryview(blob))
        t = _timed(lambda: fileio.write_with(Path(d) / "big.bin", write))
        out["DISK_BYTES_PER_S"] = {"value": 32 * blob.nbytes / t, "bytes": 32 * blob.nbytes, "seconds": t}
        print("disk", out["DISK_BYTES_PER_S"], flush=True)
        if "convert" in parts:
            from voodoo_quant.gguf.converter import convert

            f = Path(d) / "m.f32.gguf"
            t = _timed(lambda: convert(args.model, f, outtype="f32"))
            out["CONVERT_BYTES_PER_S"] = {"value": f.stat().st_size / t, "bytes": f.stat().st_size, "seconds": t}
            print("convert", out["CONVERT_BYTES_PER_S"], flush=True)
    return out


def _grid_setup() -> dict:
    """Each grid type's setup (its first quantization of 8 rows) in a fresh process."""
    setup = {}
    for t in GRID:
        code = ("import time, numpy as np; from voodoo_quant.core import ggml; from voodoo_quant.memory import rates as R;"
                f"w = R.probe_matrix(8); t0 = time.perf_counter(); ggml.lib().quantize(w, '{t}', R._imatrix(512), workers=1);"
                "print(time.perf_counter() - t0)")
        setup[t] = float(subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                                        cwd=ROOT).stdout.split()[-1])
    return setup


def _derived(repeats: int) -> dict:
    """Each grid type's seconds per weight ÷ IQ2_XXS's, plain and in each sweep's walk."""
    from voodoo_quant.core import ggml
    from voodoo_quant.memory import rates as R

    lib = ggml.lib()
    ratios: dict[str, list[dict]] = {k: [] for k in ("plain", *SWEEPS)}
    g1 = R.gemm_rate(256, 256, 2048, threads=1)
    for rep in range(repeats):
        q = R.quant_rates(GRID, lib)
        ratios["plain"].append({t: q[R.BASE] / q[t] for t in GRID})
        for sw in SWEEPS:
            cw, _ = R.compensation_rates(GRID, sw, 0.1, g1, lib)
            if cw[R.BASE] <= 0:  # the two-size fit's slope came out ≤ 0: a neighbour's load, not a rate
                print(rep, f"{sw}: {R.BASE}'s walk measured as 0 s per weight; this repeat is left out", flush=True)
                continue
            ratios[sw].append({t: cw[t] / cw[R.BASE] for t in GRID})
        print(rep, {k: {t: round(x, 2) for t, x in v[-1].items()} for k, v in ratios.items() if v}, flush=True)
    empty = [k for k, v in ratios.items() if not v]
    if empty:
        raise SystemExit(f"no usable repeat for {', '.join(empty)}: run it again on an idle machine")
    return {t: {k: statistics.median(r[t] for r in v) for k, v in ratios.items()} for t in GRID}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="cmd", required=True)
    c = sub.add_parser("constants")
    c.add_argument("--model", required=True)
    c.add_argument("--layers", type=int, default=2)
    c.add_argument("--seq_len", type=int, default=512)
    c.add_argument("--repeats", type=int, default=3)
    c.add_argument("--only", nargs="+", choices=PARTS, help="measure these only (default: all)")
    c.add_argument("--tmp", default=None)
    c.add_argument("--out", type=Path)
    r = sub.add_parser("run")
    r.add_argument("--truncate", type=int, default=0, help="first N decoder layers of --model (a copy in --work)")
    r.add_argument("--work", default="/tmp/time_model")
    r.add_argument("--out", type=Path)
    m = sub.add_parser("compare")
    m.add_argument("costs", type=Path)
    m.add_argument("--session", action="append", default=[])
    argv = list(sys.argv[1:] if argv is None else argv)
    flags = argv[argv.index("--") + 1:] if "--" in argv else []
    args = ap.parse_args(argv[:argv.index("--")] if "--" in argv else argv)
    args.flags = flags
    if args.cmd == "constants":
        out = constants(args)
        print(json.dumps(out, indent=1))
        if args.out:
            from voodoo_quant.core import fileio

            fileio.write_json(args.out, out)
        return 0
    if args.cmd == "run":
        from time_model_run import run  # noqa: E402  (bench/ sibling)

        return run(args)
    from time_model_compare import compare  # noqa: E402  (bench/ sibling)

    return compare(args)


if __name__ == "__main__":
    raise SystemExit(main())
