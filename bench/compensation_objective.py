"""Compensation on a real model's tensors: each sweep's cost and layer objective, side by side.

For the listed tensors of a few decoder layers of a float HF checkpoint, the layer-input Hessian
H = Σ xᵀx and the imatrix vector (mean x² per input column, what ``llama-imatrix`` accumulates)
are collected on calibration text: the quality benchmark's (bench/quality_texts.py, its held-out
files never read), or any ``.jsonl`` of text records. Each type is then built plain
(libggml-base's quantization of W with that vector) and compensated with each sweep
(``candidates/compensate.py``, ``candidates/compensation_walk.py``: "ruled", the default, every
grid IQ step rounded from a probe with its row's weights and its scale coded against its
superblock's ruler; "fixed", each grid IQ superblock quantized again at every step; "packed", the probe with its own weights and ruler;
"proxy", the steps of proxy_rounding.TYPES rounded in torch with no libggml-base call in the
walk; "requant", the quantizer again at every step), all on one thread, one after another on
the same matrices. Printed, as Markdown:

- per tensor and type: seconds, ÷ plain, and the layer objective tr(E H Eᵀ) / tr(W H Wᵀ) with
  E = W − Ŵ and Ŵ dequantized from the candidate's bytes; each later sweep's objective ÷ the
  first compensated sweep's;
- per type and sweep (every sweep but "requant"): time ÷ plain summed over tensors, the layer
  objective ÷ each other sweep's (geometric mean over tensors, with its range), and the fraction
  of 32-blocks (of the steps the walk rounded) whose values in the file are the walk's rounding
  to the bit, and to within 1e-3 of the block's largest: whether the error the walk passed on is
  the file's;
- per menu: seconds per 1e9 weights per core, summed over the menu's types and every tensor,
  and ÷ plain. The factor of H is computed once per layer input and shared by the types and the
  tensors reading that input; it is timed apart and counted once per input in the menu rows.

    OMP_NUM_THREADS=1 .venv/bin/python bench/compensation_objective.py \\
        --hf ~/.cache/voodoo_quant/bench-models/qwen2.5-coder-1.5b-instruct/hf-degrid0-b16 \\
        --layers 1,13,26 --sweeps fixed,ruled,packed --out objective.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from voodoo_quant.candidates import compensate, compensation_walk, grid_probe, proxy_grids  # noqa: E402
from voodoo_quant.core import ggml  # noqa: E402
from voodoo_quant.selection.menus import DEFAULT_CANDIDATES  # noqa: E402

# the product's default menu and the reference recipe's two (attention; the rest)
MENUS = {"default": DEFAULT_CANDIDATES,
         "recipe attention": ("Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS"),
         "recipe other": ("IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")}
# tensor → the module whose input it reads (tensors reading one input share its Hessian and factor)
TENSORS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
           "down_proj": "mlp.down_proj"}
INPUT = {"q_proj": "attn_in", "k_proj": "attn_in", "v_proj": "attn_in", "o_proj": "o_in",
         "gate_proj": "mlp_in", "up_proj": "mlp_in", "down_proj": "down_in"}


class _Enough(Exception):
    """Raised by a hook once the deepest layer asked for has run: the rest of the model is not needed."""


def calibration_tokens(tokenizer, jsonl: Path | None, sequences: int, seq_len: int):
    """`sequences` × `seq_len` tokens from the records of `jsonl` (default: the quality benchmark's
    plays+python calibration text), concatenated in order and cut."""
    import torch

    if jsonl is None:
        import quality_texts as qtx

        with tempfile.TemporaryDirectory(prefix="voodoo-objective-") as out:
            path = qtx.build_texts({d: qtx.domain(d) for d in qtx.DOMAINS}, qtx.DOMAINS, Path(out)).calib
            text = path.read_text(encoding="utf-8")
    else:
        text = jsonl.read_text(encoding="utf-8")
    ids: list[int] = []
    for line in text.splitlines():
        if line.strip():
            ids += tokenizer(json.loads(line)["text"], add_special_tokens=False)["input_ids"]
            if len(ids) >= sequences * seq_len:
                break
    if len(ids) < sequences * seq_len:
        raise SystemExit(f"{jsonl}: {len(ids)} tokens, {sequences} × {seq_len} asked")
    return torch.tensor(ids[:sequences * seq_len]).view(sequences, seq_len)


def collect(model, layers: list[int], tokens, batch: int) -> dict[tuple[int, str], tuple[np.ndarray, np.ndarray]]:
    """(layer, input) → (H float32 n × n, imatrix vector: mean x² per column), from one forward
    pass of `tokens` stopped after the deepest layer asked for. H is accumulated by the product's
    own hook (training/hessians.py, float32, its upper block triangle mirrored when done)."""
    import torch

    from voodoo_quant.training.hessians import accumulating_hook, finished

    acc: dict[str, torch.Tensor] = {}
    keys = {f"{L}:{INPUT[t]}": (L, INPUT[t], module) for L in layers
            for t, module in (("q_proj", "self_attn.q_proj"), ("o_proj", "self_attn.o_proj"),
                              ("gate_proj", "mlp.gate_proj"), ("down_proj", "mlp.down_proj"))}
    blocks = model.model.layers
    hooks = [blocks[L].get_submodule(m).register_forward_pre_hook(accumulating_hook(acc, k)) for k, (L, _, m) in keys.items()]

    def stop(*_):
        raise _Enough

    hooks.append(blocks[max(layers)].register_forward_hook(stop))  # every layer asked for has seen the batch
    try:
        with torch.no_grad():
            for i in range(0, tokens.shape[0], batch):
                try:
                    model.model(input_ids=tokens[i:i + batch])
                except _Enough:
                    pass
    finally:
        for h in hooks:
            h.remove()
    hs = {k: finished(acc[k]) for k in keys}  # the accumulated upper block triangle, mirrored
    return {(L, i): (hs[k], np.diagonal(hs[k]) / tokens.numel()) for k, (L, i, _) in keys.items()}


def objective(W, Wq, H) -> float:
    """tr(E H Eᵀ) / tr(W H Wᵀ), E = W − Wq (products in float32, sums in float64)."""
    import torch

    Ht, Wt = torch.from_numpy(H), torch.from_numpy(W)
    E = Wt - torch.from_numpy(np.ascontiguousarray(Wq, dtype=np.float32))
    return float(((E @ Ht) * E).double().sum() / ((Wt @ Ht) * Wt).double().sum())


DEFAULTS = {"PACK_NORM": compensation_walk.PACK_NORM, "PACK_WEIGHTS": compensation_walk.PACK_WEIGHTS,
            "WRITE_CODES": compensation_walk.WRITE_CODES, "PACKED_PROXY": compensation_walk.PACKED_PROXY,
            "WRITE_HELD": compensation_walk.WRITE_HELD}
# the packed probe's measured variants: its rows' normalization (compensation_walk.PACK_NORM) and the
# weights its search uses (compensation_walk.PACK_WEIGHTS: "row", each row's own superblock σ²; the
# "ruled" sweep adds the row superblock's ruler to those weights, grid_probe.py)
VARIANTS = {"packed-max": {"PACK_NORM": "max"}, "packed-row": {"PACK_WEIGHTS": "row"},
            "packed-max-row": {"PACK_NORM": "max", "PACK_WEIGHTS": "row"},
            # the packed walk before the K-quants' bytes were written by the walk (WRITE_CODES) and
            # IQ3_XXS and IQ2_XXS were rounded by the proxy (PACKED_PROXY)
            "packed-before": {"WRITE_CODES": False, "PACKED_PROXY": frozenset(), "WRITE_HELD": False},
            # IQ3_XXS's held levels quantized again by libggml-base instead of written by the walk
            "packed-noheld": {"WRITE_HELD": False}}


def base(sweep: str) -> str:
    """The product's sweep of a sweep name or a measured variant, with the module settings of
    that variant applied to compensation_walk (the defaults for a plain sweep name)."""
    for k, v in {**DEFAULTS, **VARIANTS.get(sweep, {})}.items():
        setattr(compensation_walk, k, v)
    return sweep.split("-")[0]


def probe_rounding(W, q: str, vec, H, lib) -> dict:
    """The packed probe as a rounding oracle, with no walk: every 32-column step of W rounded by
    the probe (rows divided by their superblock's RMS, as the walk does; the weights as
    compensation_walk.PACK_WEIGHTS says) against libggml-base's quantization of W itself (the file's
    rounding). The imatrix-weighted error and the layer objective of the probe's rounding ÷ the
    file's, the fraction of values that differ, and the fraction of 16-value groups whose grid
    pattern differs (not the file's values times one positive factor: another grid point or
    sign, not only another sub-block scale)."""
    import torch

    Wt, rows = torch.from_numpy(W), W.shape[0]
    qq = compensate.qt.get(q)
    B = lib.block_size(qq)
    full = lib.dequantize(lib.quantize(W, q, vec, workers=1), q, W.shape)
    P = np.empty_like(W)
    for s0 in range(0, W.shape[1], compensation_walk.STEP):
        b0 = (s0 // B) * B
        sq = Wt[:, b0:b0 + B].square()
        c = sq.mean(1, keepdim=True).sqrt()
        c = torch.where(c > 0, c, torch.ones_like(c))
        x = Wt[:, s0:s0 + compensation_walk.STEP] / c
        ms = sq.mean(1) / c.squeeze(1).square()
        step = slice(s0, s0 + compensation_walk.STEP)
        P[:, step] = (grid_probe.probe_rounding(x, qq, vec[step], lib, B, ms, compensation_walk.PACK_WEIGHTS)
                      * c).numpy()
    err = lambda R: float((((W - R) ** 2) * vec[None, :]).sum())  # noqa: E731
    g_p, g_f = P.reshape(-1, 16).astype(np.float64), full.reshape(-1, 16).astype(np.float64)
    alpha = (g_p * g_f).sum(1, keepdims=True) / np.maximum((g_f * g_f).sum(1, keepdims=True), 1e-300)
    pattern = ~np.all(np.abs(g_p - alpha * g_f) <= 1e-3 * np.abs(g_p).max(1, keepdims=True) + 1e-30, axis=1)
    return {"weighted_err_ratio": err(P) / err(full), "objective_ratio": objective(W, P, H) / objective(W, full, H),
            "differing": float((P != full).mean()), "pattern_differing": float(pattern.mean())}


CLOCK = time.perf_counter  # --cpu_time: time.process_time (the process's CPU seconds: on a shared
# machine, where a niced bench waits for the CPU, the work itself; everything runs on one thread)


def timed(fn):
    t = CLOCK()
    out = fn()
    return out, CLOCK() - t


def main(argv: list[str] | None = None) -> int:
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hf", type=Path, required=True, help="a float HF checkpoint (a Llama/Qwen-style decoder)")
    ap.add_argument("--calib", type=Path, default=None, help=".jsonl of {\"text\": ...} records "
                    "(default: the quality benchmark's plays+python calibration text)")
    ap.add_argument("--sequences", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--layers", default="1,13,26")
    ap.add_argument("--tensors", default="q_proj,k_proj,o_proj,gate_proj,down_proj", help=f"of {','.join(TENSORS)}")
    ap.add_argument("--types", default=None, help="default: every type of the menus")
    ap.add_argument("--sweeps", default="fixed,packed", help=f"of {','.join(compensate.SWEEPS + tuple(VARIANTS))}")
    ap.add_argument("--damp", type=float, default=compensate.DEFAULT_DAMP)
    ap.add_argument("--probe_rounding", action="store_true", help="also: the packed probe's rounding of W "
                    "itself (no walk) against the file's, per grid IQ type")
    ap.add_argument("--cpu_time", action="store_true", help="time by the process's CPU seconds, not the wall clock")
    ap.add_argument("--out", type=Path, default=None, help="write every measurement here (JSON)")
    a = ap.parse_args(argv)
    global CLOCK
    if a.cpu_time:
        CLOCK = time.process_time
    layers = [int(x) for x in a.layers.split(",")]
    tensors = a.tensors.split(",")
    sweeps = a.sweeps.split(",")
    types = a.types.split(",") if a.types else list(dict.fromkeys(t for m in MENUS.values() for t in m))
    for s in sweeps:
        if s not in compensate.SWEEPS + tuple(VARIANTS):
            raise SystemExit(f"--sweeps: {s!r} is not one of {', '.join(compensate.SWEEPS + tuple(VARIANTS))}")

    t0 = time.perf_counter()
    tok = AutoTokenizer.from_pretrained(a.hf)
    # only the decoder layers up to the deepest asked for: collect() stops there, so the rest would
    # be loaded for nothing (Qwen2.5-1.5B's layer 1: ~1.2 GB instead of 7.1 GB in float32)
    model = AutoModelForCausalLM.from_pretrained(a.hf, dtype=torch.float32, num_hidden_layers=max(layers) + 1).eval()
    tokens = calibration_tokens(tok, a.calib, a.sequences, a.seq_len)
    print(f"# model loaded; {tokens.numel()} calibration tokens; collecting the Hessians of layers {layers}", flush=True)
    stats = collect(model, layers, tokens, a.batch)
    weights = {(L, t): model.model.layers[L].get_submodule(TENSORS[t]).weight.detach().numpy().copy()
               for L in layers for t in tensors}
    del model
    print(f"# collected in {time.perf_counter() - t0:.0f} s (load included)", flush=True)

    torch.set_num_threads(1)
    lib = ggml.lib()
    for q in types:  # the first call of a grid IQ type builds its tables: not part of any candidate's time
        lib.quantize(np.zeros((1, 256), dtype=np.float32) + 0.01, q, np.ones(256, dtype=np.float32), workers=1)
        if q in proxy_grids.SPECS:  # so does the proxy's first superblock (its lattice: ~0.5 s for IQ1_S)
            b = torch.linspace(-1, 1, 256).reshape(1, 256)
            proxy_grids.HeldLevelProxy(b, q, torch.ones(256)).round(0, b)
    # every sweep's factor of a layer input kept while its tensors are built (the product builds a
    # tensor's types with one sweep, so one factor at a time would be kept there)
    compensate.FACTOR_CACHE_BYTES = 4 << 30
    rows: list[dict] = []
    factor_s: dict[tuple[int, str, str], float] = {}
    print(f"\n| tensor | shape | type | plain s | plain obj | "
          + " | ".join(f"{s} s | ÷ plain | {s} obj" for s in sweeps)
          + "".join(f" | {s} obj ÷ {sweeps[0]}" for s in sweeps[1:]) + " |", flush=True)
    print("|---|---|---|---:|---:|" + "---:|---:|---:|" * len(sweeps) + "---:|" * (len(sweeps) - 1))
    for L in layers:
        comps: dict[tuple[str, str], compensate.Compensation] = {}
        for t in tensors:
            W = weights[(L, t)]
            H, vec = stats[(L, INPUT[t])]
            for s in sweeps:
                key = (INPUT[t], s)
                if key not in comps:  # one factor per input and sweep, timed once
                    comps[key] = compensate.Compensation(H, a.damp, base(s))
                    _, secs = timed(comps[key].factor)
                    factor_s[(L, INPUT[t], s)] = secs
            for q in types:
                if W.shape[1] % lib.block_size(q):
                    continue
                row = {"layer": L, "tensor": t, "rows": W.shape[0], "cols": W.shape[1], "type": q}
                data, row["plain_s"] = timed(lambda: lib.quantize(W, q, vec, name=t, workers=1))
                row["plain_obj"] = objective(W, lib.dequantize(data, q, W.shape, name=t), H)
                for s in sweeps:
                    comp = comps[(INPUT[t], s)]
                    base(s)
                    rec: dict = {}

                    def build():  # compensate.quantize_compensated, with the walk's rounding recorded
                        Wp, own = compensate.compensated(W, q, vec, comp, lib, record=rec if comp.sweep != "requant" else None)
                        if own is not None:  # the walk wrote the bytes
                            return own
                        return lib.quantize(np.ascontiguousarray(Wp, dtype=np.float32), q, vec, name=t, workers=1)

                    data, secs = timed(build)
                    row[f"{s}_s"] = secs
                    D = lib.dequantize(data, q, W.shape, name=t)
                    row[f"{s}_obj"] = objective(W, D, H)
                    if "rounding" in rec:
                        R = rec["rounding"].reshape(-1, 32)
                        F = D.reshape(-1, 32)
                        done = ~np.isnan(R).any(1)
                        near = np.abs(F - R).max(1) <= 1e-3 * np.abs(R).max(1)
                        row[f"{s}_same"] = float((F == R).all(1)[done].mean()) if done.any() else float("nan")
                        row[f"{s}_near"] = float(near[done].mean()) if done.any() else float("nan")
                if a.probe_rounding and q in compensation_walk.RULED_SWEEP:
                    for mode in grid_probe.WEIGHT_MODES:
                        base("packed")
                        compensation_walk.PACK_WEIGHTS = mode
                        row[f"probe_{mode}"] = p = probe_rounding(W, q, vec, H, lib)
                        print(f"# {L}.{t} {q}: the probe's rounding of W (no walk, weights {mode}) ÷ the file's: "
                              f"imatrix-weighted error {p['weighted_err_ratio']:.4f}, layer objective "
                              f"{p['objective_ratio']:.4f}; values differing {p['differing']:.3f}, 16-groups of "
                              f"another grid pattern {p['pattern_differing']:.3f}", flush=True)
                    base("packed")
                rows.append(row)
                cells = " | ".join(f"{row[f'{s}_s']:.2f} | {row[f'{s}_s'] / row['plain_s']:.2f} | {row[f'{s}_obj']:.5f}"
                                   for s in sweeps)
                extra = "".join(f" | {row[f'{s}_obj'] / row[f'{sweeps[0]}_obj']:.4f}" for s in sweeps[1:])
                print(f"| {L}.{t} | {W.shape[0]}×{W.shape[1]} | {q} | {row['plain_s']:.2f} | {row['plain_obj']:.5f} | "
                      f"{cells}{extra} |", flush=True)
        compensate.release_factors()

    print("\n| type | sweep | time ÷ plain | " + " | ".join(f"obj ÷ {o} (gmean, range)" for o in sweeps)
          + " | 32-blocks as walked: same bits | within 1e-3 |")
    print("|---|---|---:|" + "---:|" * len(sweeps) + "---:|---:|")
    for q in types:
        sel = [r for r in rows if r["type"] == q]
        if not sel:
            continue
        for s in sweeps:
            cells = []
            for o in sweeps:
                rr = np.array([r[f"{s}_obj"] / r[f"{o}_obj"] for r in sel])
                cells.append(f"{np.exp(np.log(rr).mean()):.4f} ({rr.min():.4f}–{rr.max():.4f})")
            same = [r[f"{s}_same"] for r in sel if f"{s}_same" in r]
            near = [r[f"{s}_near"] for r in sel if f"{s}_near" in r]
            print(f"| {q} | {s} | {sum(r[f'{s}_s'] for r in sel) / sum(r['plain_s'] for r in sel):.2f} | "
                  + " | ".join(cells) + f" | {np.mean(same) if same else float('nan'):.3f} | "
                  f"{np.mean(near) if near else float('nan'):.3f} |")
    print("\nFactors (s, one per layer input and sweep): "
          + ", ".join(f"{L}.{i} {s} {v:.2f}" for (L, i, s), v in factor_s.items()))
    print(f"\n| menu | plain s/1e9w | " + " | ".join(f"{s} s/1e9w | ÷ plain | factor share" for s in sweeps)
          + "".join(f" | {s} obj ÷ {sweeps[0]}, summed over tensors" for s in sweeps[1:]) + " |")
    print("|---|---:|" + "---:|---:|---:|" * len(sweeps) + "---:|" * (len(sweeps) - 1))
    menus = dict(MENUS, **({"asked": tuple(types)} if a.types else {}))
    summary = {}
    for name, menu in menus.items():
        sel = [r for r in rows if r["type"] in menu]
        if not sel or any(q not in types for q in menu):
            continue
        weights_n = sum(r["rows"] * r["cols"] for r in {(r["layer"], r["tensor"]): r for r in sel}.values())
        inputs = {(r["layer"], INPUT[r["tensor"]]) for r in sel}
        plain = sum(r["plain_s"] for r in sel) / weights_n * 1e9
        line, m = f"| {name} | {plain:.0f} |", {"plain_s_per_1e9w": plain}
        for s in sweeps:
            fac = sum(factor_s[(L, i, s)] for L, i in inputs) / weights_n * 1e9
            comp_s = sum(r[f"{s}_s"] for r in sel) / weights_n * 1e9 + fac
            line += f" {comp_s:.0f} | {comp_s / plain:.2f} | {fac / comp_s:.2f} |"
            m[f"{s}_s_per_1e9w"], m[f"{s}_ratio"] = comp_s, comp_s / plain
        for s in sweeps[1:]:
            ratios = [r[f"{s}_obj"] / r[f"{sweeps[0]}_obj"] for r in sel]
            summed = sum(r[f"{s}_obj"] for r in sel) / sum(r[f"{sweeps[0]}_obj"] for r in sel)
            line += f" {summed:.4f} (per tensor {min(ratios):.4f}–{max(ratios):.4f}) |"
            m[f"{s}_objective_ratio"], m[f"{s}_objective_ratio_range"] = summed, [min(ratios), max(ratios)]
        summary[name] = m
        print(line)
    if a.out:
        from voodoo_quant.core import fileio

        argv = [v.replace(str(Path.home()), "~") for v in sys.argv[1:]]  # no machine paths in result files
        fileio.write_text(a.out, json.dumps({"argv": argv, "rows": rows, "menus": summary,
                                             "factors": [[L, i, s, v] for (L, i, s), v in factor_s.items()]}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
