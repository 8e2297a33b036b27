"""Which superblock types are compensated one whole superblock per step (compensate.WHOLE_SUPERBLOCK).

For SmolLM2-135M's ffn_down (576 × 1536 in GGUF layout: K and IQ types apply) at three depths, each
256-superblock type is compensated with 32-column steps and with whole-superblock steps, from the
calibration Hessians, imatrix and teacher of a `bench/quality.py` run (never the eval text). It
prints the layer-output error of the file's bytes, ‖(W − Ŵ)X‖² / ‖WX‖² = tr(E H Eᵀ) / tr(W H Wᵀ),
the ratio of the two steps, and the time of each, side by side in one process.

    .venv/bin/python bench/compensation_step.py --run runs/q4 --hessians runs/q4/runs/voodoo_gptq80/seed1/hessians.safetensors
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.candidates import compensate
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix  # noqa: E402
from voodoo_quant.candidates.hessian_store import load_hessians  # noqa: E402
from voodoo_quant.core import ggml  # noqa: E402
from voodoo_quant.gguf.imatrix import load as load_imatrix  # noqa: E402

TYPES = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ3_XXS",
         "IQ3_S", "IQ4_XS")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--run", default="runs/q4", help="a bench/quality.py output folder (hf/, imatrix.gguf)")
    ap.add_argument("--hessians", required=True, help="a hessians.safetensors of a compensated run on that teacher")
    ap.add_argument("--layers", default="3,15,27")
    ap.add_argument("--types", default=",".join(TYPES))
    a = ap.parse_args()
    from safetensors.numpy import load_file

    run = Path(a.run)
    hs = load_hessians(a.hessians)
    weights = load_file(str(run / "hf" / "model.safetensors"))
    imx = load_imatrix(run / "imatrix.gguf")
    lib = ggml.lib()
    print(f"{'layer':>5} {'type':8} {'plain':>9} {'32-col':>9} {'whole':>9} {'whole/32':>8} {'t 32 (s)':>8} {'t whole':>8}")
    for layer in (int(x) for x in a.layers.split(",")):
        name = f"model.layers.{layer}.mlp.down_proj.weight"
        W = np.ascontiguousarray(weights[name], dtype=np.float32)
        H = np.asarray(hs[name], dtype=np.float64)
        vec = imx.get_vector(f"blk.{layer}.ffn_down.weight", W.shape[1])
        comp = Compensation(np.asarray(hs[name], dtype=np.float32))
        comp.factor()  # kept: both steps time the walk, not the factor
        denom = np.einsum("ij,jk,ik->", W, H, W)

        def err(m: np.ndarray, q: str) -> float:
            deq = lib.dequantize(lib.quantize(m, q, vec, name="bench", workers=1), q, m.shape, name="bench")
            e = (W - deq).astype(np.float64)
            return float(np.einsum("ij,jk,ik->", e, H, e) / denom)

        saved = compensate.WHOLE_SUPERBLOCK
        for q in a.types.split(","):
            row = {}
            for label, whole in (("32", frozenset()), ("whole", frozenset({q}))):
                compensate.WHOLE_SUPERBLOCK = whole
                t0 = time.perf_counter()
                m = compensated_matrix(W, q, vec, comp)
                dt = time.perf_counter() - t0
                row[label] = (err(m, q), dt)
            compensate.WHOLE_SUPERBLOCK = saved
            (e32, t32), (ew, tw) = row["32"], row["whole"]
            print(f"{layer:>5} {q:8} {err(W, q):9.6f} {e32:9.6f} {ew:9.6f} {ew / e32:8.3f} {t32:8.2f} {tw:8.2f}", flush=True)


if __name__ == "__main__":
    main()
