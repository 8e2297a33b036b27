"""Better codes for the same scales: coordinate descent on a finished GGUF's integer codes, on each
tensor's layer objective, measured on validation text.

    .venv/bin/python bench/code_descent.py --out runs/q9 \\
        --gguf runs/q9/gguf/SmolLM2-135M-Instruct.Sensitivity80.gptq.gguf \\
        --hessians runs/q9/runs/sensitivity_gptq80/seed0/hessians.safetensors --sweeps 2

Each quantized tensor keeps its type and every block's scale and offset (the file's bytes); only
the codes move, one step along the type's grid at a time (a plain integer range, or IQ4's and
MXFP4's codebooks), where the step lowers

    tr((W − Ŵ) H (W − Ŵ)ᵀ),   H = the layer input's Hessian + damp · mean(diag H) · I

the objective GPTQ compensation minimizes greedily in one pass (the run's own Hessians, damped
alike). Rows are independent given H, so one column is updated for all rows at once; a sweep
visits every column. A Q8_0 code stays in ±127, as the quantizer writes it (some CPU dot
products take |code| with a sign trick that −128 overflows). Superblock types whose sub-block
scales are themselves codes (the K types) keep those scales. A moved tensor's values are
:func:`voodoo_quant.quants.expand` of its codes, scales and offsets: libggml's ``to_float``
arithmetic, as the packed-candidate tests check it.

It prints each tensor's objective ratio and the validation KL (paired over sequences against the
file, and as the excess ratio (KL − floor) / (file − floor) with stock Q8_0 as the floor).
Writing such codes into a GGUF is not implemented: these are bytes libggml dequantizes, not bytes
its quantizer writes (see docs/lab/2026-12-04-what-the-tensors-hold.md).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_transfer import paired, validation_args  # noqa: E402

# the integer codes each plain type's quantizer writes
CODE_RANGE = {"Q8_0": (-127, 127), "Q5_1": (0, 31), "Q5_0": (-16, 15), "Q4_0": (-8, 7), "Q4_1": (0, 15),
              "Q6_K": (-32, 31), "Q5_K": (0, 31), "Q4_K": (0, 15)}


def grids():
    """qtype -> the sorted float64 values a code may take."""
    import torch

    from voodoo_quant.quants.grids import table

    g = {t: torch.arange(lo, hi + 1, dtype=torch.float64) for t, (lo, hi) in CODE_RANGE.items()}
    g["IQ4_NL"] = g["IQ4_XS"] = torch.unique(table("kvalues_iq4nl", "cpu").double())
    g["MXFP4"] = torch.unique(table("kvalues_mxfp4", "cpu").double())
    return g


def descend(W, H, scale, offset, codes, grid, sweeps: int):
    """Codes (float64, rows × n, values of `grid`) after coordinate descent on tr(E H Eᵀ),
    E = W − (scale·codes + offset); returns (codes, objective before, after)."""
    import torch

    idx = torch.searchsorted(grid, codes)
    if not torch.equal(grid[idx.clamp(max=len(grid) - 1)], codes):
        raise ValueError("a code is not on the type's grid")
    C = codes.clone()
    E = W - (scale * C + offset)
    G = E @ H
    before = float((G * E).sum())
    hd = torch.diagonal(H)
    last = len(grid) - 1
    for _ in range(sweeps):
        moved = 0
        for j in range(W.shape[1]):
            if hd[j] <= 0:
                continue
            best = torch.zeros(W.shape[0], dtype=torch.float64)
            step = torch.zeros(W.shape[0], dtype=torch.long)
            for dk in (1, -1):
                ni = idx[:, j] + dk
                ok = (ni >= 0) & (ni <= last)
                delta = (grid[ni.clamp(0, last)] - C[:, j]) * scale[:, j]  # Ŵ_ij += delta, so E_ij −= delta
                change = -2 * delta * G[:, j] + delta * delta * hd[j]
                better = ok & (change < best)
                best = torch.where(better, change, best)
                step = torch.where(better, torch.full_like(step, dk), step)
            if bool((step != 0).any()):
                moved += int((step != 0).sum())
                ni = idx[:, j] + step
                de = (grid[ni] - C[:, j]) * scale[:, j]
                idx[:, j], C[:, j] = ni, grid[ni]
                E[:, j] -= de
                G -= de.unsqueeze(1) * H[j].unsqueeze(0)
        if moved == 0:
            break
    after = float(((E @ H) * E).sum())
    return C, before, after


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    validation_args(ap)
    ap.add_argument("--gguf", type=Path, required=True, help="the file whose types and scales stay fixed")
    ap.add_argument("--hessians", type=Path, required=True, help="the run's hessians.safetensors")
    ap.add_argument("--floor", type=Path, default=None, help="stock Q8_0 of the bench (default: <out>/gguf/*.stock-Q8_0.gguf)")
    ap.add_argument("--sweeps", type=int, default=2)
    ap.add_argument("--damp", type=float, default=0.1, help="as GPTQ's (compensate.DEFAULT_DAMP)")
    ap.add_argument("--skip", default="", help="comma list of GGUF name parts whose codes stay the file's")
    a = ap.parse_args()
    import numpy as np
    import torch

    from fixed_assignment import FixedAssignment, mean_se
    from voodoo_quant.candidates.hessian_store import load_hessians
    from voodoo_quant.quants import decompose, expand
    from voodoo_quant.quants.affine import Affine

    torch.set_grad_enabled(False)
    fa = FixedAssignment(a.out, a.val_start, a.val_sequences)
    file = fa.read(a.gguf)
    f0 = mean_se(fa.val_kl({n: t.values for n, t in fa.read(a.floor or fa.floor_path()).items()}))[0]
    kl_file = fa.val_kl({n: t.values for n, t in file.items()})
    s0, se0 = mean_se(kl_file)
    print(f"validation KL ({fa.val.shape[0]} sequences): floor {f0:.6f}, file {s0:.6f} ± {se0:.6f}", flush=True)
    hs = load_hessians(a.hessians)
    g = grids()
    skip = [s for s in a.skip.split(",") if s]
    new, total = {}, [0.0, 0.0]
    t0 = time.time()
    for n, t in file.items():
        p = fa.by[n]
        if t.qtype not in g or n not in hs or any(s in p.gguf_name for s in skip):
            continue
        af = decompose(torch.frombuffer(bytearray(t.data), dtype=torch.uint8), t.qtype, (p.rows, p.n_per_row))
        shape = (p.rows, p.n_per_row)
        scale = af.scale.unsqueeze(-1).expand_as(af.code).reshape(shape).double()
        offset = (af.offset.unsqueeze(-1).expand_as(af.code).reshape(shape).double() if af.offset is not None
                  else torch.zeros(shape, dtype=torch.float64))
        H = torch.from_numpy(np.array(hs[n], dtype=np.float64))
        H = H + a.damp * float(torch.diagonal(H).mean()) * torch.eye(H.shape[0], dtype=torch.float64)
        W = torch.from_numpy(fa.float_matrix(n)).double()
        C, before, after = descend(W, H, scale, offset, af.code.reshape(shape).double(), g[t.qtype], a.sweeps)
        moved = Affine(C.reshape(af.code.shape).to(af.code.dtype), af.scale, af.offset)
        new[n] = expand(moved).reshape(shape)
        total[0] += before
        total[1] += after
        print(f"{p.gguf_name:28s} {t.qtype:6s} layer objective {after / before:.3f}×", flush=True)
    print(f"{len(new)} tensors in {time.time() - t0:.0f} s; summed objective {total[1] / total[0]:.3f}×", flush=True)
    now = fa.val_kl({n: new.get(n, t.values) for n, t in file.items()})
    d, se = paired(kl_file, now)  # file − now: positive is better
    m = mean_se(now)[0]
    print(f"validation KL {m:.6f}: {-d:+.6f} ± {se:.6f} against the file, excess ratio {(m - f0) / (s0 - f0):.3f}",
          flush=True)


if __name__ == "__main__":
    main()
