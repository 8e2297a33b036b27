"""The guarantee's setup, done while the float weights are still there (the student replaces them):
the free references that fit the budget, their off-menu candidates, and the Fisher curvature over
every rung the search may serve. ``Trainer.prepare`` calls both once."""

from __future__ import annotations
from ..student.build import ShardedPacked
from . import fisher, layerwise
from .guarantee import plan_references, stock_provider
from .knapsack import greedy_layout
from .methods import sensitivity_choice
from .setup import candidate_sources, extra_candidate_blobs, plan_shard, reader_weights


def plan_references_for(run, base, vectors, imx, *, progress: bool = False) -> None:
    """The free references of the guarantee (``guarantee.plan_references``) and the candidates of
    their off-menu types, on `run`: plain (never error-compensated: ``setup.extra_candidate_blobs``),
    stock llama-quantize's bytes for those tensors."""
    cfg = run.cfg
    if not cfg.guarantee:
        return
    knap = None
    if run.sensitivity is not None:
        knap = {"knapsack": greedy_layout(run.plans, run.sensitivity, run.budget.upper_bytes),
                # what --method sensitivity writes: a different knapsack, and not always the worse one
                "knapsack+polish" if cfg.polish else "knapsack at target": sensitivity_choice(run)}
    stock = stock_provider(run.plans, getattr(base, "config", None), has_imatrix=imx is not None)
    menu_types = sorted({t for p in run.plans for t in p.menu.types})
    refs = plan_references(run.plans, run.budget.upper_bytes, covered=set(vectors), knapsack=knap, stock=stock,
                           stock_ftypes=cfg.stock_references, menu_types=menu_types)
    run.references = refs
    weights = reader_weights(base, run.plans)  # a --lazy skeleton's are read one at a time
    run.extra_blobs = extra_candidate_blobs(run.plans, weights, vectors, refs.extra, progress=progress,
                                            keep=_rank_shard(run) if run.tp is not None else None,
                                            hashes=run.candidate_sha256)


def _rank_shard(run):
    """(plan, type, bytes) -> what a tensor-parallel rank holds of an off-menu candidate: for a
    split tensor the bytes its shard comes from (``student.ShardedPacked``, as a ``--lazy`` rank
    holds the menu's), for a replicated one the whole bytes. Kept as each is read, so a rank never
    holds the whole model's off-menu bytes."""
    import torch

    def keep(plan, qtype: str, blob: bytes):
        sh = plan_shard(run.tp_plan, plan)
        if sh is None:
            return blob
        return ShardedPacked.build(plan, [blob], sh, run.tp.rank, run.tp.world, torch.device("cpu"), torch.float32,
                                   types=(qtype,))
    return keep


def complete_curvature(run, base, vectors, sens, *, save: bool = True) -> None:
    """Curvature matrices over every rung the search may serve: the menu and the references'
    off-menu types (the Fisher diagonal is recomputed only if a stored table lacked them); with
    `save`, stored with the table so the next size of a ladder finds these rungs. A stored entry
    names the off-menu types it priced from plain bytes (``"plain"``); one priced before those
    were plain (from compensated bytes) is priced again."""
    cfg = run.cfg
    if run.curvature is None:
        return
    off = {p.name: {t for (n, t) in run.extra_blobs if n == p.name} for p in run.plans}

    def priced(p) -> bool:
        c = run.curvature[p.name]
        return set(p.menu.types) | off[p.name] <= set(c["types"]) and off[p.name] <= set(c.get("plain", ()))

    need = [p for p in run.plans if not priced(p)]
    if not need:
        return
    weights = reader_weights(base, run.plans)
    sources = candidate_sources(need, weights, vectors)

    def blobs_for(p):  # the whole tensor's bytes, read from the cache (a TP rank holds its shard)
        blobs = dict(zip(p.menu.types, sources(p)))
        extra = {t for (n, t) in run.extra_blobs if n == p.name}
        if extra:
            blobs.update({t: b for (_, t), b in extra_candidate_blobs([p], weights, vectors, {p.name: extra}).items()})
        return blobs

    calib = run.tokens[: cfg.sensitivity_sequences]
    if sens.fisher is None:  # another Fisher pass, one decoder layer at a time, for the tensors that need it
        curv, _ = layerwise.fisher_curvature(base, need, calib, blobs_for, weights, seed=cfg.seed, device=run.device)
        run.curvature.update(curv)
    else:  # the table's pass ran on the whole model: its diagonals were kept
        for p in need:
            types, m = fisher.curvature(p, weights[p.name], sens.fisher[p.name], blobs_for(p))
            run.curvature[p.name] = {"types": types, "m": m.tolist()}
    for p in need:  # its off-menu rungs priced from the plain bytes the run holds
        run.curvature[p.name]["plain"] = sorted(set(run.curvature[p.name]["types"]) - set(p.menu.types))
    if save:
        sens.save(run.plans)

