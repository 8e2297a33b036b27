"""Can gradient descent improve what a fixed assignment's tensors hold? Trains the values of a
finished GGUF's quantized tensors on the end-to-end KL(teacher ‖ student), straight-through the
rounding, and measures the result on validation training sequences (never the eval plays).

    .venv/bin/python bench/learned_values.py --out runs/q9 --mode requant \\
        --gguf runs/q9/gguf/SmolLM2-135M-Instruct.Sensitivity80.gptq.gguf \\
        --hessians runs/q9/runs/sensitivity_gptq80/seed0/hessians.safetensors --steps 20 --lr 0.001

Two modes, both starting exactly from the file (checked):

- ``requant``: the float matrix handed to libggml-base's quantizer is the parameter P (started at
  GPTQ's W', whose quantization is the file's bytes; ``--hessians`` of the run that made it). The
  forward uses ``P + (dequantize(quantize(P)) − P).detach()``, so the file stays what the stock
  quantizer writes for some float matrix: the product's contract. ``--lr`` is a fraction of each
  tensor's rms quantization error.
- ``codes``: the scales and offsets stay the file's and each weight's integer code is learned
  (AutoRound's idea; the bytes would be ours, not the quantizer's). ``--lr`` is in code units.
  Types with a non-uniform grid (IQ*) keep their codes.

Every ``--eval_every`` steps it prints the validation KL, its paired change against the start
and the excess ratio (KL − floor) / (start − floor), the floor being ``--floor`` (stock Q8_0).
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from code_descent import CODE_RANGE  # noqa: E402
from search_transfer import paired, validation_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    validation_args(ap)
    ap.add_argument("--gguf", type=Path, required=True, help="the file whose assignment stays fixed")
    ap.add_argument("--floor", type=Path, default=None, help="stock Q8_0 of the bench (default: <out>/gguf/*.stock-Q8_0.gguf)")
    ap.add_argument("--mode", choices=("requant", "codes"), default="requant")
    ap.add_argument("--hessians", type=Path, default=None, help="requant: the Hessians the file's W' was made with")
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--lr", type=float, default=0.001)
    ap.add_argument("--batch", type=int, default=4, help="training sequences per step")
    ap.add_argument("--train_sequences", type=int, default=1024, help="steps draw from the first N training sequences")
    ap.add_argument("--skip", default="", help="comma list of GGUF name parts whose values stay the file's")
    ap.add_argument("--eval_every", type=int, default=10)
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    if a.train_sequences > a.val_start:
        raise SystemExit("--train_sequences must end before --val_start")
    if a.mode == "requant" and a.hessians is None:
        raise SystemExit("--mode requant starts from GPTQ's W': pass the run's --hessians")
    import numpy as np
    import torch

    from fixed_assignment import FixedAssignment, mean_se
    from voodoo_quant.core import ggml
    from voodoo_quant.candidates.compensate import DEFAULT_DAMP, compensated_matrix, compensations
    from voodoo_quant.candidates.hessian_store import load_hessians
    from voodoo_quant.quants import decompose, expand

    torch.manual_seed(a.seed)
    lib = ggml.lib()
    fa = FixedAssignment(a.out, a.val_start, a.val_sequences, a.batch)
    by, vectors = fa.by, fa.vectors
    skip = [s for s in a.skip.split(",") if s]
    train = fa.tokens[:a.train_sequences]
    file = fa.read(a.gguf)
    start = {n: (t.qtype, t.data, t.values) for n, t in file.items()}
    kl_floor = fa.val_kl({n: t.values for n, t in fa.read(a.floor or fa.floor_path()).items()})
    kl_start = fa.val_kl({n: t.values for n, t in file.items()})
    f0, s0 = mean_se(kl_floor)[0], mean_se(kl_start)[0]
    print(f"validation KL ({fa.val.shape[0]} sequences): floor {f0:.6f}, start {s0:.6f} ± {mean_se(kl_start)[1]:.6f}",
          flush=True)

    fixed = {n: w for n, (_, _, w) in start.items()}
    params, lrs, hard = {}, {}, {}
    if a.mode == "requant":
        comps = compensations(load_hessians(a.hessians), DEFAULT_DAMP)
        for n, (ty, data, w) in start.items():
            p = by[n]
            if any(s in p.gguf_name for s in skip):
                continue
            W = fa.float_matrix(n)
            init = compensated_matrix(W, ty, vectors.get(p.gguf_name), comps[n], lib) if n in comps else W
            params[n] = torch.from_numpy(np.ascontiguousarray(init)).requires_grad_(True)
            lrs[n] = a.lr * float((w - torch.from_numpy(W)).pow(2).mean().sqrt())

        def quantized(n):
            p, ty = by[n], start[n][0]
            data = lib.quantize(np.ascontiguousarray(params[n].detach().numpy()), ty, vectors.get(p.gguf_name), name=n)
            return torch.from_numpy(np.ascontiguousarray(lib.dequantize(data, ty, (p.rows, p.n_per_row), name=n))), data

        for n in params:
            hard[n], data = quantized(n)
            if data != start[n][1]:
                raise SystemExit(f"{n}: quantizing W' does not give the file's bytes (wrong --hessians?)")

        def soft(n):
            return params[n] + (hard[n] - params[n]).detach()

        def refresh():
            for n in params:
                hard[n] = quantized(n)[0]
    else:
        affine = {}
        for n, (ty, data, w) in start.items():
            p = by[n]
            if ty not in CODE_RANGE or any(s in p.gguf_name for s in skip):
                continue
            af = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), ty, (p.rows, p.n_per_row))
            if not torch.equal(expand(af).reshape(p.rows, p.n_per_row), w):
                raise SystemExit(f"{n}: the affine form does not expand to libggml's dequantization")
            affine[n] = af
            params[n] = af.code.float().clone().requires_grad_(True)
            lrs[n] = a.lr

        def values(n, codes):
            af = affine[n]
            w = af.scale.unsqueeze(-1) * codes
            if af.offset is not None:
                w = w + af.offset.unsqueeze(-1)
            return w.reshape(by[n].rows, by[n].n_per_row)

        def clamped(n):
            return params[n].clamp(*CODE_RANGE[start[n][0]])

        def soft(n):
            c = clamped(n)
            return values(n, c + (torch.round(c) - c).detach())

        def refresh():
            with torch.no_grad():
                for n in params:
                    hard[n] = values(n, torch.round(clamped(n)))

        refresh()
    print(f"{a.mode}: {len(params)} of {len(start)} tensors trained", flush=True)
    opt = torch.optim.Adam([{"params": [params[n]], "lr": lrs[n]} for n in params], betas=(0.9, 0.99))
    for step in range(1, a.steps + 1):
        t1 = time.time()
        x = train[torch.randint(0, train.shape[0], (a.batch,))]
        tlp = fa.teacher_logp(x)
        with torch.enable_grad():
            loss = fa.kl({n: soft(n) if n in params else fixed[n] for n in fixed}, x, tlp).mean()
            opt.zero_grad()
            loss.backward()
        opt.step()
        refresh()
        changed = sum(int((hard[n] != start[n][2]).sum()) for n in params)
        print(f"step {step}: training KL {loss.item():.6f}, weights changed {changed} ({time.time() - t1:.1f} s)", flush=True)
        if step % a.eval_every == 0 or step == a.steps:
            now = fa.val_kl({n: hard.get(n, fixed[n]) for n in fixed})
            d, se = paired(kl_start, now)  # start − now: positive is better
            m = mean_se(now)[0]
            print(f"  validation KL {m:.6f}: {-d:+.6f} ± {se:.6f} against the start, "
                  f"excess ratio {(m - f0) / (s0 - f0):.3f}", flush=True)


if __name__ == "__main__":
    main()
