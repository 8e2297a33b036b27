"""The layer objective of the two compensation sweeps on a real model's tensors, side by side.

For SmolLM2-135M (the folder a `voodoo quantize` run writes: work/hf/, imatrix.gguf, and the
Hessians of its compensated training run), each listed tensor at three depths is quantized plain,
compensated with the "requant" sweep (the quantizer again at every 32-column step) and with the
"fixed" sweep (a superblock quantized once, later steps rounded with its scales). Printed: the
layer-output error of the file's bytes, tr(E H Eᵀ) / tr(W H Wᵀ) with E = W − Ŵ, and fixed ÷ requant.

    .venv/bin/python bench/compensation_objective.py --run out --hessians out/work/runs/Voodoo60/hessians.safetensors
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.core import ggml  # noqa: E402
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix  # noqa: E402
from voodoo_quant.candidates.hessian_store import load_hessians  # noqa: E402
from voodoo_quant.gguf.imatrix import load as load_imatrix  # noqa: E402

WIDE = ("Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "Q8_0", "Q5_0")  # ffn_down: 1536-wide rows
NARROW = ("Q8_0", "Q5_0", "Q4_0", "IQ4_NL")  # 576-wide rows: what the fallbacks leave


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", required=True, help="a voodoo quantize output folder (work/hf/, imatrix.gguf)")
    ap.add_argument("--hessians", required=True)
    ap.add_argument("--layers", default="3,15,27")
    a = ap.parse_args()
    import torch
    from safetensors.numpy import load_file

    torch.set_num_threads(1)
    run = Path(a.run)
    hf = next((run / "work" / "hf").iterdir())
    weights = load_file(str(hf / "model.safetensors"))
    hs = load_hessians(a.hessians)
    imx = load_imatrix(run / "imatrix.gguf")
    lib = ggml.lib()
    print(f"{'tensor':34} {'type':7} {'plain':>9} {'requant':>9} {'fixed':>9} {'fixed/requant':>13}")
    ratios: dict[str, list[float]] = {}
    # attn_q is stored with its rows permuted for llama.cpp's rope; rows are quantized independently
    # and H acts on columns, so the HF layout gives the same objective
    for layer in (int(x) for x in a.layers.split(",")):
        for hf_name, gguf, types in ((f"model.layers.{layer}.mlp.down_proj.weight", f"blk.{layer}.ffn_down.weight", WIDE),
                                     (f"model.layers.{layer}.self_attn.q_proj.weight", f"blk.{layer}.attn_q.weight", NARROW)):
            W = np.ascontiguousarray(weights[hf_name], dtype=np.float32)
            H = np.asarray(hs[hf_name], dtype=np.float32)
            H64 = H.astype(np.float64)
            vec = imx.get_vector(gguf, W.shape[1])
            denom = float(np.sum((W.astype(np.float64) @ H64) * W))

            def err(m: np.ndarray, q: str) -> float:
                deq = lib.dequantize(lib.quantize(m, q, vec, name="bench", workers=1), q, m.shape, name="bench")
                e = (W - deq).astype(np.float64)
                return float(np.sum((e @ H64) * e)) / denom

            comps = {sw: Compensation(H, sweep=sw) for sw in ("requant", "fixed")}
            for q in types:
                p = err(W, q)
                r = err(compensated_matrix(W, q, vec, comps["requant"]), q)
                f = err(compensated_matrix(W, q, vec, comps["fixed"]), q)
                ratios.setdefault(q, []).append(f / r)
                print(f"{hf_name:34} {q:7} {p:9.6f} {r:9.6f} {f:9.6f} {f / r:13.3f}", flush=True)
    print("fixed / requant per type (min–max over tensors): " + ", ".join(
        f"{q} {min(v):.3f}–{max(v):.3f}" for q, v in ratios.items()))


if __name__ == "__main__":
    main()
