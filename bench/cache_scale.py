"""Candidate-cache build time at scale: seconds per 1e9 weights per core, per type and per menu.

Quantizes realistic matrices (Gaussian weights with a heavy-tailed column scale, as trained
Linear weights have, and an imatrix vector of the same shape) on ONE thread with libggml-base,
exactly as a cache worker does (``ggml.quantize(..., workers=1)``), for the reference recipe's
menus (SPEC.md: Q8_0 Q5_K IQ3_S IQ2_S IQ2_XXS IQ1_S and IQ4_XS), at two shapes: 4096×4096 and the
27B ``down_proj`` row length (17408). IQ grid initialization is timed apart (once per worker).

The 27B figure is the measured per-type rates applied to every selectable tensor of the
Qwen3.5-27B-shaped config (bench/configs/qwen35_27b) with the recipe's attention / other menus:
a projection from measured rates, printed as such.

    python bench/cache_scale.py [--rows 4096] [--out bench/results/cache_scale.json]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

TYPES = ("Q8_0", "Q5_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
ATTN = ("Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS")
OTHER = ("IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
CONFIG_27B = Path(__file__).resolve().parent / "configs" / "qwen35_27b"


def matrix(rows: int, cols: int, seed: int) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(seed)
    col_scale = np.exp(rng.standard_normal(cols) * 0.5).astype(np.float32)  # log-normal column scales
    w = (rng.standard_normal((rows, cols)).astype(np.float32) * 0.02) * col_scale
    imx = (col_scale ** 2 * rng.uniform(0.5, 1.5, cols)).astype(np.float32)
    return np.ascontiguousarray(w), imx


def measure(shapes, types=TYPES) -> dict:
    from voodoo_quant.core import ggml
    from voodoo_quant.core import qtypes as qt

    lib = ggml.lib()
    init = {}
    for t in types:
        t0 = time.perf_counter()
        lib._ensure_init(qt.get(t))
        init[t] = time.perf_counter() - t0
    rates: dict[str, dict[str, float]] = {}
    for rows, cols in shapes:
        w, imx = matrix(rows, cols, rows + cols)
        key = f"{rows}x{cols}"
        rates[key] = {}
        for t in types:
            use = None if qt.get(t).is_float else imx
            t0 = time.perf_counter()
            lib.quantize(w, t, use, name=key, workers=1)
            dt = time.perf_counter() - t0
            rates[key][t] = dt / (rows * cols) * 1e9
            print(f"  {key:>11} {t:8} {dt:7.2f} s  = {rates[key][t]:8.1f} s per 1e9 weights per core", flush=True)
    return {"init_s": init, "s_per_1e9_weights_per_core": rates}


def project_27b(rates: dict[str, dict[str, float]]) -> dict:
    """Σ over the 27B config's selectable tensors of weights × the measured rate of each menu type
    (the 17408-wide rate for 17408-wide rows, the 4096×4096 one otherwise)."""
    from voodoo_quant.arch import adapter_for
    from voodoo_quant.model.lazyload import text_skeleton
    from voodoo_quant.selection.menus import MenuConfig
    from voodoo_quant.student.build import plan_model, selectable_weights

    model = text_skeleton(CONFIG_27B)
    adapter = adapter_for(model.config)
    covered = {adapter.gguf_name(n) for n in selectable_weights(model)}  # the recipe passes an imatrix
    plans = plan_model(model, adapter, MenuConfig(TYPES[:2] + TYPES[3:], ATTN, OTHER), imatrix_names=covered)
    wide = next(k for k in rates if k.endswith("x17408"))
    square = next(k for k in rates if not k.endswith("x17408"))
    total, weights, by_type = 0.0, 0, {}
    for p in plans:
        n = p.rows * p.n_per_row
        weights += n
        r = rates[wide] if p.n_per_row == 17408 else rates[square]
        for t in (ATTN if p.role == "attention" else OTHER):
            s = r[t] * n / 1e9
            by_type[t] = by_type.get(t, 0.0) + s
            total += s
    return {"selectable_weights": weights, "core_seconds": total, "core_hours": total / 3600,
            "by_type_core_hours": {t: s / 3600 for t, s in by_type.items()}, "tensors": len(plans)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=4096, help="rows of the 4096-wide matrix")
    ap.add_argument("--wide_rows", type=int, default=2048, help="rows of the 17408-wide matrix")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    print("one core, libggml-base, imatrix on every non-float type")
    res = measure([(a.rows, 4096), (a.wide_rows, 17408)])
    proj = project_27b(res["s_per_1e9_weights_per_core"])
    res["projection_27b"] = proj
    for key, r in res["s_per_1e9_weights_per_core"].items():
        attn = sum(r[t] for t in ATTN)
        other = sum(r[t] for t in OTHER)
        print(f"{key}: attention menu {attn:,.0f} s, other menu {other:,.0f} s, per 1e9 weights per core")
    print(f"27B-shaped config ({proj['selectable_weights'] / 1e9:.2f}e9 selectable weights, {proj['tensors']} tensors): "
          f"projected {proj['core_hours']:.1f} core-hours for every candidate "
          f"(= {proj['core_hours'] / 16:.1f} h on 16 cores, {proj['core_hours'] / 64:.1f} h on 4 hosts x 16 cores "
          f"with --shard i/4)")
    print("init (s, once per worker):", {t: round(s, 2) for t, s in res["init_s"].items()})
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
