"""Sensitivity table: how much each candidate of each tensor perturbs that tensor's outputs.

    s(t, q) = ‖(W_q − W) X‖² / ‖W X‖²

over the inputs X that tensor sees on calibration tokens. A hooked forward pass of the float
model collects, per use of a tensor, the Gram matrix ``C = Σ_i x_i x_iᵀ`` of a Linear's inputs
(float32, on the run's device, for groups of tensors within ``GRAM_BYTES``: one pass per group; so
``‖ΔW X‖² = Σ (ΔW C) ⊙ ΔW`` needs no token loop), or the token counts of an Embedding's lookups
(``Σ_v n_v ‖ΔW[v]‖²``). A tied embedding / LM head sums both uses. The candidates W_q are the
very bytes training uses (the candidate cache), dequantized by libggml-base.

The table is written beside the journal (``sensitivity.pt``) with what it was computed from, and
reused when a run is resumed or finalized with the same model, menus and calibration tokens.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping, Sequence

import torch
import torch.nn as nn

from ..core import fileio
from ..gguf.imatrix import vector_hash
from . import layerwise
from ..experimental.measured import measured_table
from .provenance import model_weights_sha256
from .setup import candidate_sources, reader_weights

log = logging.getLogger(__name__)

TABLE_NAME = "sensitivity.pt"
TABLE_VERSION = 2


# Gram matrices held at once (float32 bytes): plans are captured in groups under this, one
# calibration pass per group, so the statistics never hold the model's Σ columns² at once (a 27B
# model's would be ~100 GB in float32). A small model is one group: one pass, as before.
GRAM_BYTES = 1 << 31


class _Stats:
    """Per-module input statistics, accumulated in float32 on `device` (the run's device; default:
    where each input is)."""

    def __init__(self, device: torch.device | None = None) -> None:
        self.device = device
        self.gram: dict[str, torch.Tensor] = {}
        self.counts: dict[str, torch.Tensor] = {}

    def _dev(self, t: torch.Tensor) -> torch.device:
        return self.device if self.device is not None else t.device

    def hook_linear(self, name: str):
        def hook(mod, args, _out):
            x = args[0].detach().reshape(-1, args[0].shape[-1])
            x = x.to(device=self._dev(x), dtype=torch.float32)
            g = x.t() @ x
            self.gram[name] = g if name not in self.gram else self.gram[name].add_(g)
        return hook

    def hook_embedding(self, name: str, vocab: int):
        def hook(mod, args, _out):
            ids = args[0].detach().reshape(-1)
            c = torch.bincount(ids.to(self._dev(ids)), minlength=vocab)  # int64: exact counts
            self.counts[name] = c if name not in self.counts else self.counts[name].add_(c)
        return hook


def capture_inputs(model: nn.Module, plans: Sequence, tokens: torch.Tensor, device: torch.device | None = None) -> _Stats:
    """One no-grad forward over `tokens` ([n, seq]) with hooks on every use of every planned tensor."""
    modules = dict(model.named_modules())
    stats = _Stats(device)
    handles = []
    try:
        for p in plans:
            for mname in p.modules:
                mod = modules[mname]
                if isinstance(mod, nn.Embedding):
                    handles.append(mod.register_forward_hook(stats.hook_embedding(mname, mod.num_embeddings)))
                else:
                    handles.append(mod.register_forward_hook(stats.hook_linear(mname)))
        with torch.no_grad():
            for row in tokens:
                model(input_ids=row.unsqueeze(0))
    finally:
        for h in handles:
            h.remove()
    return stats


def gram_bytes(plan, modules: dict) -> int:
    """float32 bytes of the statistics of `plan` (a Gram per Linear use, counts per Embedding use)."""
    n = 0
    for mname in plan.modules:
        mod = modules[mname]
        n += mod.num_embeddings * 8 if isinstance(mod, nn.Embedding) else getattr(mod, "in_features", 0) ** 2 * 4
    return n


def capture_groups(model: nn.Module, plans: Sequence, budget: int = GRAM_BYTES) -> list[list]:
    """`plans` in order, cut into groups whose statistics fit `budget` (a larger plan alone)."""
    modules = dict(model.named_modules())
    groups: list[list] = [[]]
    used = 0
    for p in plans:
        b = gram_bytes(p, modules)
        if groups[-1] and used + b > budget:
            groups.append([])
            used = 0
        groups[-1].append(p)
        used += b
    return [g for g in groups if g]


def _output_energy(w: torch.Tensor, mname: str, stats: _Stats) -> float:
    """‖w X‖² for one use of the tensor (0 when the use saw no input); `w` float32 on the
    statistics' device."""
    if mname in stats.gram:
        c = stats.gram[mname]
        return float(((w @ c) * w).sum(dtype=torch.float64))
    if mname in stats.counts:
        c = stats.counts[mname].to(torch.float32)
        return float(((w * w).sum(dim=1) * c).sum(dtype=torch.float64))
    return 0.0


def _stats_device(plan, stats: _Stats) -> torch.device:
    for m in plan.modules:
        t = stats.gram.get(m, stats.counts.get(m))
        if t is not None:
            return t.device
    return torch.device("cpu")


def tensor_sensitivities(plan, weight: torch.Tensor, blobs: Sequence[bytes], stats: _Stats) -> list[float]:
    """s(t, q) for every rung of `plan`'s menu, from the rung's ggml bytes."""
    dev = _stats_device(plan, stats)
    w = weight.detach().to(device=dev, dtype=torch.float32)
    den = sum(_output_energy(w, m, stats) for m in plan.modules)
    out = []
    for qtype, blob in zip(plan.menu.types, blobs):
        wq = plan.dequantize(blob, qtype).to(device=dev, dtype=torch.float32).reshape(w.shape)
        num = sum(_output_energy(wq - w, m, stats) for m in plan.modules)
        out.append(num / den if den > 0 else 0.0)
    return out


def table_key(plans: Sequence, tokens: torch.Tensor, model: str, *, weights_sha256: str,
              vectors: Mapping, seed: int) -> str:
    """What a table depends on: model, every tensor's menu and bytes, the calibration tokens, the
    float weights (``provenance`` hash: another --base_checkpoint changes every s), the
    imatrix vector each tensor's candidates are quantized with (another imatrix changes them), the
    error compensation they were quantized with, and the seed (the Fisher pass draws its labels from it; an output-error table without curvature
    does not use it, and is recomputed for another seed all the same)."""
    h = hashlib.sha256()
    h.update(json.dumps([[p.name, list(p.menu.types), list(p.sizes)] for p in plans]).encode())
    h.update(str(model).encode())
    h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
    h.update(weights_sha256.encode())
    h.update(json.dumps(sorted((str(k), vector_hash(v)) for k, v in vectors.items())).encode())
    h.update(f"seed {seed}".encode())
    comp = getattr(vectors, "compensation", None)  # compensated candidates are other candidates
    if comp:
        h.update(json.dumps(sorted((p.name, [comp[p.name].digest_for(t) for t in p.menu.types])
                                   for p in plans if p.name in comp)).encode())
    return h.hexdigest()[:16]


def compute_table(
    model: nn.Module, plans: Sequence, weights: Mapping[str, torch.Tensor],
    blobs_for, tokens: torch.Tensor, *, device: torch.device | None = None, budget: int = GRAM_BYTES,
) -> dict[str, list[float]]:
    """tensor -> [s per menu rung]. `blobs_for(plan)` returns the rung bytes (from the cache).
    The statistics are float32 on `device`, captured for groups of plans within `budget` bytes
    (one calibration pass per group), each group's freed before the next."""
    table = {}
    for group in capture_groups(model, plans, budget):
        stats = capture_inputs(model, group, tokens, device)
        for p in group:
            table[p.name] = tensor_sensitivities(p, weights[p.name], blobs_for(p), stats)
        del stats
    return table


def save_table(path: Path, table: Mapping[str, Sequence[float]], key: str, plans: Sequence,
               curvature: Mapping[str, dict] | None = None) -> Path:
    menus = {p.name: list(p.menu.types) for p in plans}
    return fileio.torch_save(path, {"version": TABLE_VERSION, "key": key, "menus_json": json.dumps(menus),
                                    "table_json": json.dumps({k: list(map(float, v)) for k, v in table.items()}),
                                    "curvature_json": json.dumps(curvature) if curvature is not None else None})


def load_stored(path: Path, key: str) -> tuple[dict[str, list[float]], dict | None] | None:
    """(table, curvature or None) if stored from the same inputs (`key`), else None."""
    if not path.exists():
        return None
    d = fileio.torch_load(path, what="sensitivity table")
    if not isinstance(d, dict) or d.get("version") != TABLE_VERSION or d.get("key") != key:
        log.info("%s was computed from other inputs; recomputing", path)
        return None
    table = {k: list(v) for k, v in json.loads(d["table_json"]).items()}
    curv = json.loads(d["curvature_json"]) if d.get("curvature_json") else None
    return table, curv


def load_table(path: Path, key: str) -> dict[str, list[float]] | None:
    """The stored table if it was computed from the same inputs (`key`), else None."""
    got = load_stored(path, key)
    return None if got is None else got[0]


def warm_logits(plans: Sequence, layout: Mapping[str, int], tau: float, mass: float) -> dict[str, torch.Tensor]:
    """Gate logits whose softmax at temperature `tau` puts `mass` on the layout's rung and
    spreads the rest evenly: ``g = τ · log q``, so step 0 serves q exactly."""
    out = {}
    for p in plans:
        k = len(p.menu.types)
        if k == 1:
            out[p.name] = torch.zeros(1)
            continue
        q = torch.full((k,), (1.0 - mass) / (k - 1), dtype=torch.float64)
        q[layout[p.name]] = mass
        out[p.name] = (tau * torch.log(q)).float()
    return out


@dataclass
class Sensitivity:
    """A run's sensitivity table (tensor -> s per menu rung), and, for the Fisher kind or when the
    search needs it, the curvature matrices (``fisher.curvature``); the whole model's Fisher
    diagonals only where the pass ran on the whole model (a loaded model the layer-by-layer road
    refuses): the search's off-menu rungs are priced from them, else by another pass
    (``references.complete_curvature``)."""

    table: dict[str, list[float]]
    curvature: dict[str, dict] | None = None
    fisher: dict[str, torch.Tensor] | None = None
    path: Path | None = None  # where it is stored, and the key it was stored under
    key: str | None = None

    def save(self, plans: Sequence) -> None:
        """Store the table again (after the curvature was extended to more rungs), so that the next
        run with the same inputs (another size of a ladder) needs no second Fisher pass."""
        if self.path is not None and self.key is not None:
            save_table(self.path, self.table, self.key, plans, self.curvature)


def ensure_table(cfg, base: nn.Module, plans: Sequence, vectors, tokens: torch.Tensor,
                 *, progress: bool = False, need_curvature: bool = False,
                 device: torch.device | None = None, hashes: dict | None = None) -> Sensitivity:
    """The run's sensitivity table of ``--sensitivity_kind``: reused from
    ``<output_dir>/sensitivity.pt`` when it was made from the same inputs, else computed from the
    float `base` (before the gates replace its weights) on the first ``--sensitivity_sequences``
    sequences, and saved there. ``fisher`` (downstream-aware, ``fisher.py``), ``output`` (each
    tensor's own output error, above) or ``measured`` (every rung's ΔKL measured, ``measured.py``)."""
    kind = cfg.sensitivity_kind
    calib = tokens[: cfg.sensitivity_sequences]
    key = table_key(plans, calib, cfg.model, weights_sha256=model_weights_sha256(base, plans), vectors=vectors or {},
                    seed=cfg.seed)
    key = f"{key}-{kind}"
    path = cfg.out_dir / TABLE_NAME
    stored = load_stored(path, key)
    names = {p.name for p in plans}
    if stored is not None and set(stored[0]) == names and (stored[1] is not None or not need_curvature):
        return Sensitivity(stored[0], stored[1], path=path, key=key)
    streamed = layerwise.applies(base)  # a skeleton: one decoder layer at a time (layerwise.py)
    if streamed and kind != "fisher":
        raise ValueError(f"the {kind} table reads the loaded model (training/models.py sensitivity_model)")
    weights = reader_weights(base, plans)
    sources = candidate_sources(plans, weights, vectors or {}, progress=progress, hashes=hashes)  # the cache training reads too

    def blobs_for(p):
        return dict(zip(p.menu.types, sources(p)))

    curv = fish = None
    if kind == "fisher" or need_curvature:  # one decoder layer at a time (layerwise.py), a loaded model in place
        curv, fish = layerwise.fisher_curvature(base, plans, calib, blobs_for, weights, seed=cfg.seed, device=device)
    if kind == "fisher":
        table = {n: [c["m"][k][k] for k in range(len(c["types"]))] for n, c in curv.items()}
    elif kind == "measured":
        table = measured_table(base, plans, sources, calib, device=device, progress=progress)
    else:
        table = compute_table(base, plans, weights, sources, calib, device=device)
    cfg.out_dir.mkdir(parents=True, exist_ok=True)
    save_table(path, table, key, plans, curv)
    return Sensitivity(table, curv, fish, path=path, key=key)
