"""The memory model's loss-chunk term against one measured chunk of the tensor-parallel loss.

The reference recipe's largest flag-dependent term is the loss chunk: ``--loss_chunk_size`` tokens
× this rank's vocabulary (62080 at 27B / TP-4) in float32. Here one checkpointed chunk of
``training.tp_losses._tp_chunk`` (the rank's CE and KL, as ``tp_distill_terms`` runs it) goes forward and
backward on the CPU in a one-process gloo group at the recipe's per-rank vocabulary; the peak RSS
above what was held before (the hidden states and both heads, which are other terms of the model)
is compared with :func:`voodoo_quant.memory.plan.loss_chunk_bytes`. The hidden size does not enter the
term, so it defaults to 256: the CPU's bf16 matmuls at 5120 take minutes, and a CPU linear over a
62080 x 5120 float32 head makes a reordered copy of the head (1.27 GB) that would hide the chunk.

    python bench/loss_memory.py [--tokens 1024 2048 4096] [--vocab 62080] [--hidden 256] [--dtype float32] [--out FILE]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _rss() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def child(tokens: int, vocab: int, hidden: int, dtype: str) -> None:
    import torch
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from voodoo_quant.distributed.parallel import TPContext
    from voodoo_quant.training.tp_losses import _tp_chunk

    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", "29517")
    dist.init_process_group("gloo", rank=0, world_size=1)
    tp = TPContext(0, 1)
    dt = getattr(torch, dtype)
    g = torch.Generator().manual_seed(0)
    h = torch.randn(tokens, hidden, generator=g).to(dt).requires_grad_(True)
    th = torch.randn(tokens, hidden, generator=g).to(dt)
    w = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dt)
    tw = (torch.randn(vocab, hidden, generator=g) * 0.02).to(dt)
    tgt = torch.randint(0, vocab, (tokens,), generator=g)
    before = _rss()
    ce, kl = checkpoint(_tp_chunk, h, w, None, th, tw, None, tgt, 0, tp, use_reentrant=False)
    (ce + kl).backward()
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    print("LOSS_PEAK", peak - before, flush=True)
    from voodoo_quant.distributed.parallel import leave

    leave()  # meet, tear down, exit without the interpreter's teardown (gloo can abort there)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child":
        child(int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), sys.argv[5])
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, nargs="+", default=[1024, 2048, 4096])
    ap.add_argument("--vocab", type=int, default=62080)
    ap.add_argument("--hidden", type=int, default=256)
    ap.add_argument("--dtype", default="float32")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args()
    from voodoo_quant.memory.plan import loss_chunk_bytes

    rows = []
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "2"}
    db = 2 if a.dtype in ("bfloat16", "float16") else 4
    for t in a.tokens:
        p = subprocess.run([sys.executable, str(Path(__file__).resolve()), "--child", str(t), str(a.vocab),
                            str(a.hidden), a.dtype], capture_output=True, text=True, env=env, cwd=ROOT)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("LOSS_PEAK")]
        if p.returncode != 0 or not got:
            raise SystemExit(f"chunk of {t} tokens failed:\n{p.stderr[-3000:]}")
        meas = float(got[-1].split()[1])
        pred = loss_chunk_bytes(t, a.vocab, db)
        rows.append({"tokens": t, "vocab": a.vocab, "hidden": a.hidden, "dtype": a.dtype, "predicted": pred,
                     "measured": meas, "error": (pred - meas) / meas})
        print(f"{t:6} tokens x {a.vocab} vocab ({a.dtype}): predicted {pred / 1e9:.2f} GB  measured "
              f"{meas / 1e9:.2f} GB  error {(pred - meas) / meas:+.1%}", flush=True)
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
