"""Where one training step's time goes, on any device: phases and the top kernels.

One trainer is prepared (``TrainConfig`` + ``Trainer.prepare``: the student with its gated
candidates, the teacher, Adam on the gates), warmed up, and then ``Trainer._step`` is run
``--steps`` times, first with every phase timed (the device synchronized at each phase's ends, so
the phases add up; the synchronization costs a little), then under ``torch.profiler`` with no
phase clocks. Printed: the median step, each phase's share (the mixtures' forward products and
backward dots, the teacher's forward, the student's forward with its mixing, the loss), and the
operators with the most self time on the device (CUDA) or the host, as ``torch.profiler`` sums them.

    python bench/gpu_step_profile.py MODEL_DIR --device cuda --dtype bfloat16 --lazy \
        --gradient_checkpointing --seq_len 2048 --menu Q8_0 Q4_K Q2_K [--out FILE]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--lazy", action="store_true")
    ap.add_argument("--gradient_checkpointing", action="store_true")
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--menu", nargs="+", default=["Q8_0", "Q4_K", "Q2_K"])
    ap.add_argument("--ratio", type=float, default=0.45)
    ap.add_argument("--rows", type=int, default=25, help="operators printed")
    ap.add_argument("--out", type=Path, default=None, help="also write the report here")
    a = ap.parse_args()

    from voodoo_quant.core import fileio
    from voodoo_quant.student import layers
    from voodoo_quant.model.modeling import load_config
    from voodoo_quant.training import losses
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    dev = torch.device(a.device)
    sync = (lambda: torch.cuda.synchronize(dev)) if dev.type == "cuda" else (lambda: None)
    work = Path(tempfile.mkdtemp(prefix="voodoo-step-profile-"))
    vocab = load_config(a.model).vocab_size
    g = torch.Generator().manual_seed(0)
    n = 2 * a.steps + 4
    tokens = fileio.torch_save(work / "data" / "train_tokens.pt", torch.randint(0, vocab, (n, a.seq_len), generator=g))
    cfg = TrainConfig(model=str(a.model), data_dir=str(tokens.parent), data_name=tokens.name, compression_ratio=a.ratio,
                      seq_len=a.seq_len, batch_size=1, max_steps=1000, candidate_types=tuple(a.menu),
                      output_dir=str(work / "run"), device=a.device, dtype=a.dtype, lazy=a.lazy,
                      gradient_checkpointing=a.gradient_checkpointing, warm_start=False, polish=False,
                      guarantee=False, error_compensation="none", search_sequences=0)
    t0 = time.perf_counter()
    trainer = Trainer(cfg)
    run = trainer.prepare()
    setup_s = time.perf_counter() - t0
    opt = torch.optim.Adam([m.gates for m in run.mixed.values()], lr=cfg.lr)

    spent: dict[str, float] = {}

    def clock(obj, attr, phase):
        inner = getattr(obj, attr)

        def timed_call(*args, **kw):
            sync()
            t = time.perf_counter()
            try:
                return inner(*args, **kw)
            finally:
                sync()
                spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t
        setattr(obj, attr, staticmethod(timed_call) if isinstance(obj, type) else timed_call)
        return lambda: setattr(obj, attr, inner if not isinstance(obj, type) else staticmethod(inner))

    def step(i: int) -> float:
        sync()
        t = time.perf_counter()
        trainer._step(run, opt, i)
        sync()
        return time.perf_counter() - t

    step(0)  # warm-up: allocations, kernel selection
    restore = [clock(layers._Mix, "forward", "mixing: forward products"),
               clock(layers._Mix, "backward", "mixing: backward dots"),
               clock(run.teacher, "forward", "teacher forward"),
               clock(run.student, "forward", "student forward (its mixing included)"),
               clock(losses, "full_losses", "loss")]
    phased, shares = [], {}
    for i in range(a.steps):
        spent.clear()
        phased.append(step(1 + i))
        for k, v in spent.items():
            shares.setdefault(k, []).append(v)
    for r in reversed(restore):
        r()
    plain = [step(1 + a.steps + i) for i in range(a.steps)]
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev.type == "cuda" else [])
    with torch.profiler.profile(activities=acts) as prof:
        for i in range(a.steps):
            step(1 + 2 * a.steps + i)
    sort = "self_cuda_time_total" if dev.type == "cuda" else "self_cpu_time_total"
    med = statistics.median(plain)
    lines = [f"{a.model.name}: {a.device} {a.dtype} {'lazy' if a.lazy else 'eager'} "
             f"{'checkpointed ' if a.gradient_checkpointing else ''}seq {a.seq_len}, menu {' '.join(a.menu)}; "
             f"setup {setup_s:.1f} s",
             f"step (median of {a.steps}, no clocks): {med:.3f} s; with phase clocks {statistics.median(phased):.3f} s"]
    for k, v in sorted(shares.items(), key=lambda kv: -statistics.median(kv[1])):
        lines.append(f"  {k:40s} {statistics.median(v):8.3f} s  {statistics.median(v) / statistics.median(phased):6.1%}")
    lines.append(prof.key_averages().table(sort_by=sort, row_limit=a.rows, max_name_column_width=60))
    text = "\n".join(lines)
    print(text, flush=True)
    if a.out is not None:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(text)


if __name__ == "__main__":
    main()
