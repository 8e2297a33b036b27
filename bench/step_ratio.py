"""Training step vs plain forward+backward, side by side in one run: where the step time goes.

One trainer is prepared (``TrainConfig`` + ``Trainer.prepare``: the real student with its gated
candidates, the teacher, Adam on the gates) and its step (``Trainer._step``: CE + λ·KL, backward
to the gates, the size penalty, Adam) is timed in several variants on the same batch, interleaved
with the plain baselines on that batch (every other repeat in reverse order), for several repeats:

- ``mix=loop``  the soft mixture as it was before this bench (one temporary per candidate in the
  forward, ``(g * W_k).sum()`` per candidate in the backward), kept here as the reference;
- ``mix=codes``  the current step: the candidates kept as int8 codes and sub-block scales
  (``compact.CompactCandidates``), mixed and dotted by the native kernel (``mixkernel``), each
  mixture written into a tensor kept across steps (``layers.MixBuffers``);
- ``mix=gemv``  the step before the codes: float32 stacks of the same candidates (the same
  values), one matrix-vector product over the stack in the forward, one dot product per candidate
  in the backward, kept buffers (``VOODOO_MIX_KERNEL=0`` trains this way);
- ``mix=gemv, fresh mixtures``  the same with every mixture a fresh tensor, as before the buffers;
- ``mix=gemv, tied per module``  the same inside ``parametrize.cached()`` alone, as the trainer
  ran before ``layers.cached()``: a tied embedding / LM head mixed (and its gradient dotted with
  every candidate) once for each of its two modules;
- ``+ teacher cache``  the current mixture with the teacher's final hidden states read from a
  warm ``training/teacher_cache.py`` cache (what every size of a ladder after the first gets).

Baselines, at the same shape and tokens: ``plain`` = the same HF model with float weights
requiring grad, one forward + backward of the same loss (``losses.distill_terms``, teacher
forward included), as ``bench/speed.py`` measures it; ``plain student`` = the student's forward +
backward alone (CE, no teacher). Ratios are taken per repeat against the baseline measured in the
same repeat. Printed per variant: the median of those ratios with a 95 % bootstrap interval
(resampling repeats), and the ratio of the two minima (each side's least disturbed repeat: on a
shared VM the noise only ever adds time). ``--variants`` times a subset, so that a long run of
just the current step against its baselines fits in minutes; ``--phases`` also times each run's
parts (the mixing products and dots, the student and teacher forwards, the loss) and prints
their medians.

    .venv/bin/python bench/step_ratio.py --model DIR [--imatrix F] [--seq_len 256] [--repeats 7]
        [--variants mix=gemv] [--phases]
"""

from __future__ import annotations

import argparse
import copy
import os
import random
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
# What the `voodoo` CLI applies to its own process (huge pages for torch's CPU tensors): the
# in-process trainer here runs as the CLI's does. Before torch allocates anything large.
from voodoo_quant.hardware.envdefaults import apply_env_defaults, host_env_defaults  # noqa: E402

apply_env_defaults(host_env_defaults(), os.environ)

import torch  # noqa: E402

VARIANTS = ("mix=loop", "mix=gemv, tied per module", "mix=gemv, fresh mixtures", "mix=gemv", "mix=codes",
            "mix=codes + teacher cache")
MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_XS", "IQ4_NL", "Q3_K", "IQ3_S", "IQ2_S")


class LoopMix(torch.autograd.Function):
    """The soft mixture before the stacked product (layers._Mix at commit 875f3be), for reference."""

    @staticmethod
    def forward(ctx, p, get, k_count, dtype, limit=None, buf=None):  # noqa: D401 (fresh tensors: no buffers)
        acc = torch.promote_types(dtype, torch.float32)
        cand = (lambda k: get[k]) if isinstance(get, torch.Tensor) else get
        out = None
        for k in range(k_count):
            term = cand(k).to(acc) * p[k].to(acc)
            out = term if out is None else out.add_(term)
        ctx.acc, ctx.cand, ctx.k_count = acc, cand, k_count
        ctx.save_for_backward(p)
        return out.to(dtype)

    @staticmethod
    def backward(ctx, grad_w):
        (p,) = ctx.saved_tensors
        g = grad_w.to(ctx.acc)
        grads = torch.stack([(g * ctx.cand(k).to(ctx.acc)).sum() for k in range(ctx.k_count)])
        return grads.to(p.dtype), None, None, None, None, None


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def median_ci(ratios: list[float], draws: int = 2000, seed: int = 0) -> tuple[float, float]:
    """95 % percentile-bootstrap interval of the median of `ratios` (repeats resampled)."""
    rng = random.Random(seed)
    meds = sorted(statistics.median(rng.choices(ratios, k=len(ratios))) for _ in range(draws))
    return meds[int(0.025 * draws)], meds[int(0.975 * draws) - 1]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, required=True, help="HF checkpoint dir (e.g. the demo's work/hf/<Model>)")
    ap.add_argument("--imatrix", type=Path, default=None, help="imatrix for the IQ rungs (e.g. the demo's imatrix.gguf)")
    ap.add_argument("--tokens", type=Path, default=None, help="train_tokens.pt (default: random tokens)")
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--repeats", type=int, default=7, help="timed repeats after one warm-up")
    ap.add_argument("--menu", nargs="+", default=list(MENU))
    ap.add_argument("--variants", nargs="+", default=None, choices=VARIANTS,
                    help="time only these trainer-step variants (default: all); the baselines always run")
    ap.add_argument("--phases", action="store_true",
                    help="also time each run's phases (mixing, student and teacher forwards, loss; medians)")
    a = ap.parse_args()

    from voodoo_quant.core import fileio
    from voodoo_quant.student import layers
    from voodoo_quant.model.modeling import load_config, load_model
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.losses import distill_terms
    from voodoo_quant.training.teacher_cache import wrap_teacher
    from voodoo_quant.training.trainer import Trainer

    work = Path(tempfile.mkdtemp(prefix="voodoo-step-ratio-"))
    if a.tokens is None:
        vocab = load_config(a.model).vocab_size
        g = torch.Generator().manual_seed(0)
        a.tokens = fileio.torch_save(work / "data" / "train_tokens.pt",
                                     torch.randint(0, vocab, (a.repeats + 1, a.seq_len), generator=g))
    cfg = TrainConfig(model=str(a.model), data_dir=str(Path(a.tokens).parent), data_name=Path(a.tokens).name,
                      imatrix=str(a.imatrix) if a.imatrix else None, compression_ratio=0.65, seq_len=a.seq_len,
                      batch_size=a.batch_size, max_steps=1000, candidate_types=tuple(a.menu),
                      output_dir=str(work / "run"), warm_start=False, polish=False)
    trainer = Trainer(cfg)
    run = trainer.prepare()
    opt = torch.optim.Adam([m.gates for m in run.mixed.values()], lr=cfg.lr)
    teacher = run.teacher
    cached_teacher, cache = wrap_teacher(teacher, work / "hidden")

    plain = load_model(a.model, dtype=torch.float32)
    plain_teacher = copy.deepcopy(plain).eval()
    for p in plain_teacher.parameters():
        p.requires_grad_(False)
    for p in plain.parameters():
        p.requires_grad_(True)

    from voodoo_quant.training.schedule import batch_indices

    def ids_at(step):
        return run.tokens[batch_indices(step, cfg.batch_size, run.tokens.shape[0], cfg.seed)]

    def plain_step(step, with_teacher=True):
        plain.zero_grad(set_to_none=True)
        ids = ids_at(step)
        if with_teacher:
            ce, kl = distill_terms(plain, plain_teacher, ids, chunk_tokens=cfg.loss_chunk_size)
            (ce + kl).backward()
        else:
            logits = plain(input_ids=ids).logits[:, :-1]
            torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1)).backward()

    from voodoo_quant.candidates.compact import CompactCandidates

    codes = {mq: mq._get for mq in run.mixed.values() if isinstance(mq._get, CompactCandidates)}
    stacks = {mq: torch.stack([cc(k) for k in range(mq.k)]) for mq, cc in codes.items()}  # the same values
    if not codes:
        print("note: no tensor holds int8 codes (no C compiler, or VOODOO_MIX_KERNEL=0): mix=codes is mix=gemv")

    def hold(float_stacks: bool) -> None:
        for mq, cc in codes.items():
            mq.stacked = stacks[mq] if float_stacks else None
            mq._get = (lambda k, st=stacks[mq]: st[k]) if float_stacks else cc

    def step_with(mix, teacher_module, cached=None, float_stacks=True):
        def go(step):
            hold(float_stacks)
            layers._Mix = mix
            layers.cached = cached or NEW_CACHED
            run.teacher = teacher_module
            try:
                trainer._step(run, opt, step)
            finally:
                layers._Mix = NEW_MIX
                layers.cached = NEW_CACHED
                run.teacher = teacher
        return go

    from torch.nn.utils import parametrize

    NEW_MIX, NEW_CACHED = layers._Mix, layers.cached

    def per_module(buffers=None):  # parametrize.cached() alone: no memo per MixedQuant, no buffers
        return parametrize.cached()

    def fresh(buffers=None):  # layers.cached() without the buffers kept across steps
        return NEW_CACHED()

    variants = {"mix=loop": step_with(LoopMix, teacher, per_module),
                "mix=gemv, tied per module": step_with(NEW_MIX, teacher, per_module),
                "mix=gemv, fresh mixtures": step_with(NEW_MIX, teacher, fresh),
                "mix=gemv": step_with(NEW_MIX, teacher),
                "mix=codes": step_with(NEW_MIX, teacher, float_stacks=False),
                "mix=codes + teacher cache": step_with(NEW_MIX, cached_teacher, float_stacks=False)}
    variants = {k: v for k, v in variants.items() if a.variants is None or k in a.variants}
    if "mix=codes + teacher cache" in variants:
        with torch.no_grad():  # warm the teacher cache on every batch the repeats use
            for step in range(a.repeats + 1):
                cached_teacher(input_ids=ids_at(step))
    runs = {"plain": plain_step, "plain student": lambda step: plain_step(step, False), **variants}
    times = {k: [] for k in runs}
    spent: dict[str, float] = {}  # phase -> seconds in the current run (--phases)
    phases: dict[str, dict[str, list[float]]] = {k: {} for k in runs}
    if a.phases:
        from voodoo_quant.training import losses

        def clock(obj, attr, phase):
            inner = getattr(obj, attr)

            def timed_call(*args, **kw):
                t0 = time.perf_counter()
                try:
                    return inner(*args, **kw)
                finally:
                    spent[phase] = spent.get(phase, 0.0) + time.perf_counter() - t0
            setattr(obj, attr, staticmethod(timed_call) if isinstance(obj, type) else timed_call)

        clock(NEW_MIX, "forward", "mixing (forward products)")
        clock(NEW_MIX, "backward", "mixing (backward dots)")
        for m in (teacher, plain_teacher):  # a warm teacher cache's reads are in no phase
            clock(m, "forward", "teacher forward")
        for m in (run.student, plain):
            clock(m, "forward", "student forward (mixing included)")
        clock(losses, "full_losses", "loss")
    for step in range(a.repeats + 1):
        # Every other repeat in reverse order: what one run leaves behind (freed memory, caches)
        # falls on a different neighbour each time instead of always on the same one.
        order = list(runs) if step % 2 == 0 else list(reversed(runs))
        row = {}
        for name in order:
            spent.clear()
            row[name] = timed(lambda: runs[name](step))
            if step:
                for ph, v in spent.items():
                    phases[name].setdefault(ph, []).append(v)
        if step == 0:
            continue  # warm-up
        for k, v in row.items():
            times[k].append(v)
    print(f"model {a.model} seq_len {a.seq_len} batch {a.batch_size}, {a.repeats} repeats after 1 warm-up, "
          f"torch threads {torch.get_num_threads()}; teacher cache hits {cache.hits if cache else 0}; "
          f"THP_MEM_ALLOC_ENABLE={os.environ.get('THP_MEM_ALLOC_ENABLE')}")
    print(f"{'':28} {'median s':>9} {'min s':>7} {'/ plain':>8} {'95 % interval':>14} {'min/min':>8} "
          f"{'/ plain student':>16}")
    for k, v in times.items():
        r1 = [x / p for x, p in zip(v, times["plain"])]
        lo, hi = median_ci(r1)
        r2 = statistics.median(x / p for x, p in zip(v, times["plain student"]))
        print(f"{k:28} {statistics.median(v):9.3f} {min(v):7.3f} {statistics.median(r1):8.2f} "
              f"{f'{lo:.2f}-{hi:.2f}':>14} {min(v) / min(times['plain']):8.2f} {r2:16.2f}")
    if a.phases:
        print("phases, median s per run (the forward's mixing happens inside the student forward):")
        for k, ph in phases.items():
            print(f"  {k:28} " + ", ".join(f"{n} {statistics.median(v):.3f}" for n, v in sorted(ph.items())))
    base = times.get("mix=codes")
    if base is None:
        return
    print("paired difference from mix=codes (same repeat, same batch), mean ± s.e. over repeats:")
    for k, v in times.items():
        if k != "mix=codes" and len(v) > 1:
            d = [x - y for x, y in zip(v, base)]
            print(f"  {k:28} {statistics.mean(d):+7.3f} ± {statistics.stdev(d) / len(d) ** 0.5:.3f} s")


if __name__ == "__main__":
    main()
