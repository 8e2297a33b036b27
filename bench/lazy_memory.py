"""Memory saved by ``--lazy`` and the speed of the torch dequantization kernels.

For one matrix and a menu, prints the bytes of the full candidate set kept packed (what --lazy
holds: the quantized bytes, as PackedTensors) against the same candidates held dequantized in
float32 and in bf16; then, per type, the torch kernel's dequantization time relative to ggml's
``to_float`` on the same bytes (side by side in one run: best of ``--repeat`` timings each,
after one warm-up, since a shared machine makes single timings noisy; ratio > 1 means torch is
slower). Bytes are random valid blocks (the cost of decoding does not depend on
the values), so no IQ quantizer initialization is needed. Every torch result is checked equal
to ggml's before it is timed.

    .venv/bin/python bench/lazy_memory.py --rows 4096 --cols 4096 [--device cuda]
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import torch

from voodoo_quant.core import ggml
from voodoo_quant.core import qtypes as qt
from voodoo_quant.quants import PackedTensor
from voodoo_quant.quants.random_blocks import random_blocks

MENU = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_S",
        "IQ2_XXS", "IQ1_S", "Q5_0", "Q5_1", "Q4_0")


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _best(repeat: int, fn, device: torch.device) -> float:
    best = float("inf")
    for _ in range(max(1, repeat)):
        _sync(device)
        t0 = time.perf_counter()
        fn()
        _sync(device)
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--cols", type=int, default=2048)
    ap.add_argument("--menu", default=",".join(MENU), help="comma-separated type names")
    ap.add_argument("--device", default="cpu")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--threads", type=int, default=1,
                    help="torch CPU threads (1 = like ggml's single-threaded to_float)")
    ap.add_argument("--repeat", type=int, default=3, help="timings per kernel; the best is kept")
    args = ap.parse_args()

    device = torch.device(args.device)
    torch.set_num_threads(max(1, args.threads))
    shape = (args.rows, args.cols)
    menu = [qt.resolve_for_row(t, args.cols).name for t in args.menu.split(",")]
    menu = list(dict.fromkeys(menu))  # fallbacks may collapse duplicates, as in a real menu
    lib = ggml.lib()
    rng = np.random.default_rng(args.seed)
    n = args.rows * args.cols

    print(f"matrix {shape}, {len(menu)} candidates: {', '.join(menu)}; device {device}; "
          f"torch threads {torch.get_num_threads()}, ggml to_float single-threaded")
    print(f"{'type':8} {'packed MiB':>11} {'bpw':>6} {'ggml ms':>9} {'torch ms':>9} {'torch/ggml':>10}")
    packed_total = 0
    for name in menu:
        q = qt.get(name)
        data = random_blocks(q, n // q.block, rng).reshape(-1)
        p = PackedTensor.from_bytes(data, q, shape, device=device)
        packed_total += p.nbytes

        ref = lib.dequantize(data, q, shape)  # warm-up (page faults, allocator)
        t_ggml = _best(args.repeat, lambda: lib.dequantize(data, q, shape), device)
        out = p.dequantize()  # warm-up: table upload, kernel load on GPU
        t_torch = _best(args.repeat, p.dequantize, device)
        if not torch.equal(out.cpu().view(torch.int32), torch.from_numpy(ref).view(torch.int32)):
            raise SystemExit(f"{name}: torch kernel differs from ggml to_float")
        print(f"{name:8} {p.nbytes / 2**20:11.2f} {p.nbytes * 8 / n:6.3f} {t_ggml * 1e3:9.1f} "
              f"{t_torch * 1e3:9.1f} {t_torch / t_ggml:10.2f}")
        del out, ref

    f32 = len(menu) * n * 4
    bf16 = len(menu) * n * 2
    print(f"\ncandidate set of this matrix: packed {packed_total / 2**20:.2f} MiB | "
          f"float32 {f32 / 2**20:.2f} MiB ({f32 / packed_total:.2f}x packed) | "
          f"bf16 {bf16 / 2**20:.2f} MiB ({bf16 / packed_total:.2f}x packed)")
    print(f"--lazy saves {(f32 - packed_total) / 2**20:.2f} MiB vs float32 "
          f"({1 - packed_total / f32:.1%}), {(bf16 - packed_total) / 2**20:.2f} MiB vs bf16 "
          f"({1 - packed_total / bf16:.1%})")


if __name__ == "__main__":
    main()
