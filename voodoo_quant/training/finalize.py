"""After the bake: measure the gates' assignment against the free references, keep the best, and
improve it by the measured-KL search (``guarantee.py``, ``search.py``). The trainer calls
``improve`` once, with the student built and the held-aside split set apart in its setup."""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

import torch

from ..selection.menus import is_pinned
from ..student.build import ShardedPacked
from .guarantee import Candidate, pin, rung_bytes
from .objective import HeldAside, TPHeldAside
from .rungs import Rungs, menu_rungs, release, serve, types_of
from ..experimental.search import JOURNAL_NAME, SearchEvent, confirm, local_search, search_key

log = logging.getLogger(__name__)


@dataclass
class Outcome:
    types: dict[str, str]  # tensor -> the type written
    sizes: dict[str, int]  # tensor -> its bytes
    winner: str  # the best measured candidate: written as is, or the search's start
    candidates: list[Candidate] = field(default_factory=list)
    search: dict | None = None

    def report(self) -> dict:
        kept = self.search and self.search.get("confirm", {}).get("kept", True)
        final = self.search["final_kl"] if kept else next(c.kl for c in self.candidates if c.name == self.winner)
        return {"winner": self.winner, "final_kl": final, "candidates": [c.to_dict() for c in self.candidates],
                "search": self.search}


def _extra_weights(plan, held: Mapping[str, object], device: torch.device) -> Callable[[str], torch.Tensor]:
    """An off-menu type -> its weight on `device`, dequantized from what the run holds: the whole
    tensor's bytes, or a tensor-parallel rank's shard of them (``student.ShardedPacked``)."""
    def make(qtype: str) -> torch.Tensor:
        h = held[qtype]
        return (h(0) if isinstance(h, ShardedPacked) else plan.dequantize(h, qtype)).to(device)
    return make


def run_rungs(run) -> dict[str, Rungs]:
    """Every tensor's rungs: its menu, plus the references' off-menu types the run holds bytes of
    (added to a tensor's ladder with ``Rungs.add`` when an assignment uses them)."""
    by = {p.name: p for p in run.plans}
    rungs: dict[str, Rungs] = menu_rungs(run.plans, run.mixed)
    for n, r in rungs.items():
        extra = {t: b for (name, t), b in run.extra_blobs.items() if name == n}
        if extra:
            r.extra = _extra_weights(by[n], extra, run.device)
    return rungs


def improve(run, gate_choices: Sequence[tuple[str, Mapping[str, int]]], *,
            on_eval: Callable[[SearchEvent], None] | None = None) -> Outcome:
    """Measure `gate_choices` ((name, tensor -> menu index), the bake first) and the run's
    references on the held-aside split, then search from the best. Leaves the student as it was.
    Under tensor parallelism every rank measures and searches together (the same values, so the
    same decisions, on each; rank 0 alone writes the journal, every rank resumes from it), and
    a split tensor's off-menu rungs come from the rank's shard of their bytes."""
    cfg, plans = run.cfg, run.plans
    hi = float(run.budget.upper_bytes)
    lo = run.budget.target_bytes * (1.0 - run.budget.tolerance)
    by = {p.name: p for p in plans}
    rungs = run_rungs(run)
    baked = {n: by[n].menu.types[k] for n, k in gate_choices[0][1].items()}
    cands = [Candidate(name, {n: by[n].menu.types[k] for n, k in ch.items()}, sum(by[n].sizes[k] for n, k in ch.items()))
             for name, ch in gate_choices]
    for ref in run.references.candidates if run.references else ():
        c = pin(ref, baked, plans, cfg.upgrades)
        if c.total_bytes <= hi:
            cands.append(c)
    for c in cands:
        for n, t in c.types.items():
            rungs[n].add(t, by[n].sizes[by[n].menu.types.index(t)] if t in by[n].menu.types else rung_bytes(by[n], t))
    def split(tokens: torch.Tensor) -> HeldAside:
        if run.tp is not None:
            return TPHeldAside(run.student, run.teacher, tokens, run.tp, device=run.device,
                               teacher_device=run.teacher_device, chunk_tokens=cfg.loss_chunk_size,
                               sharded=run.tp_sharded)
        return HeldAside(run.student, run.teacher, tokens, device=run.device, teacher_device=run.teacher_device,
                         chunk_tokens=cfg.loss_chunk_size)

    held = split(run.held_tokens)
    try:
        measured = {}
        for c in cands:
            idx = {n: rungs[n].index(t) for n, t in c.types.items()}
            serve(rungs, idx)
            m = held.measure()
            c.kl, c.kl_stderr = m.kl, m.stderr
            measured[c.name] = (idx, m)
            log.info("guarantee: %s %.0f bytes, held-aside KL %.6f ± %.6f", c.name, c.total_bytes, m.kl, m.stderr)
        best = min(cands, key=lambda c: (c.kl, c.total_bytes, c.name))
        start, start_m = measured[best.name]
        search = None
        current = start
        if cfg.search_evals > 0:
            main = run.tp is None or run.tp.is_main
            pinned = {n for n in rungs if is_pinned(n, cfg.upgrades)}
            # off_menu: the references' off-menu rungs are plain bytes (setup.extra_candidate_blobs); a
            # journal measured on compensated ones is not resumed
            settings = {"result_hash": cfg.result_hash(), "reprobe": 4, "hi": hi, "lo": lo, "margin": cfg.search_margin,
                        "off_menu": "plain"}
            key = search_key(types_of(rungs, start), held, settings)
            res = local_search(rungs, start, held, lo=lo, hi=hi, max_evals=cfg.search_evals, pinned=pinned,
                               journal_path=cfg.out_dir / JOURNAL_NAME, write_journal=main, key=key,
                               start_measurement=start_m, on_eval=on_eval if main else None,
                               curvature=run.curvature, margin=cfg.search_margin)
            current, search = res.current, res.summary()
            if res.accepted and run.confirm_tokens is not None:
                del held  # its teacher cache and layer outputs: the confirmation split holds its own
                check = confirm(rungs, start, current, split(run.confirm_tokens))
                search["confirm"] = check.summary()
                log.info("search: on %d sequences it never saw, KL %.6f -> %.6f (drop %+.6f ± %.6f): %s",
                         len(check.final.per_sequence), check.start.kl, check.final.kl, search["confirm"]["drop"],
                         search["confirm"]["drop_stderr"], "kept" if check.kept else "the start is written")
                if not check.kept:
                    current = start
        types = types_of(rungs, current)
        sizes = {n: rungs[n].sizes[current[n]] for n in rungs}
    finally:
        release(rungs)
    return Outcome(types, sizes, best.name, cands, search)

