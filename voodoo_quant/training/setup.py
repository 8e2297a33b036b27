"""Everything a run needs before its first step, from the loaded models (:mod:`.models`): data,
imatrix, plans, budget, candidates and gates."""

from __future__ import annotations

import hashlib

import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
import torch.nn as nn

from ..arch import adapter_for
from ..arch.base import ArchAdapter
from ..candidates.cache import CandidateCache
from ..candidates.compensate import applies, compensation_of
from ..candidates.precache import CandidateJob, build_all
from ..core import envs, fileio
from ..core import qtypes as qt
from ..core.errors import ConfigError, CorruptFileError
from ..gguf import imatrix as im
from ..model.lazyload import meta_names, set_tensor
from ..selection.budget import Budget
from ..student.build import (
    TensorPlan, attach_all, build_mixed, candidate_bytes, candidate_jobs, converter_layouts, fixed_tensors, plan_model,
    prior_logits, selectable_weights,
)
from ..student.layers import MixBuffers, MixedQuant
from .config import TrainConfig
from .models import materialize, reader_of
from .target_size import run_budget

log = logging.getLogger(__name__)


def load_tokens(path: Path, seq_len: int) -> torch.Tensor:
    """A [N, seq_len] int64 tensor from a tokens file written by ``voodoo data``."""
    obj = fileio.torch_load(path, what="tokens file")
    if isinstance(obj, dict):
        for key in ("input_ids", "tokens"):
            if key in obj:
                obj = obj[key]
                break
    if not isinstance(obj, torch.Tensor) or obj.dim() != 2 or obj.dtype not in (torch.int64, torch.int32):
        raise CorruptFileError(f"tokens file {path} does not hold a 2-D integer tensor of sequences")
    if obj.shape[0] == 0:
        raise CorruptFileError(f"tokens file {path} holds no sequences")
    if obj.shape[1] < seq_len:
        raise ConfigError(
            f"--seq_len {seq_len} is longer than the sequences in {path} ({obj.shape[1]} tokens); "
            f"rerun `voodoo data --seq_len {seq_len}` or lower --seq_len"
        )
    return obj[:, :seq_len].to(torch.int64).contiguous()


def tiny(cfg: TrainConfig) -> TrainConfig:
    """VOODOO_TINY_RECIPE=1: at most 4 steps, for tests and smoke runs."""
    if envs.tiny_recipe():
        cfg.max_steps = min(cfg.max_steps, 4)
    return cfg


def reader_weights(model: nn.Module, plans):
    """name -> float weight of every planned tensor: a loaded model's own, or for a skeleton read
    from its checkpoint one at a time when asked."""
    reader = reader_of(model)
    if reader is not None:
        return _ReaderWeights(reader, {p.name: p.shape for p in plans})
    return {n: w for n, (w, _) in selectable_weights(model).items()}


def load_imatrix(cfg: TrainConfig):
    if not cfg.imatrix:
        return None
    return im.load(cfg.imatrix)


def imatrix_vectors(imx, plans_or_layouts) -> dict[str, np.ndarray]:
    """GGUF name -> the quantizer's vector, for every planned tensor the imatrix covers. An imatrix
    that covers none of them is another model's (or another naming's): refused, where the run
    would otherwise quantize every candidate without it while recording that it used it. An entry
    for a tensor the model lacks is ignored, as stock llama-quantize ignores it (src/llama-quant.cpp
    looks each tensor up); a planned tensor without an entry is quantized without one, as there (its
    menu has no type that needs one: ``plan_model``)."""
    if imx is None:
        return {}
    out, names = {}, []
    for p in plans_or_layouts:
        if p.gguf_name is not None:
            names.append(p.gguf_name)
            v = imx.get_vector(p.gguf_name, p.n_per_row)
            if v is not None:
                out[p.gguf_name] = v
    if names and not out:
        src = getattr(imx, "source", None)
        raise im.ImatrixMismatchError(
            f"imatrix{f' {src}' if src else ''} covers none of the model's {len(names)} selectable tensors "
            f"(e.g. {sorted(names)[0]}; its entries are like {min(imx.entries, default='none')}): "
            "it was made for another model")
    return out


@dataclass
class RunSetup:
    cfg: TrainConfig
    adapter: ArchAdapter
    student: nn.Module
    teacher: nn.Module
    tokens: torch.Tensor
    plans: list[TensorPlan]
    budget: Budget
    mixed: dict[str, MixedQuant]
    imatrix_info: dict
    device: torch.device
    dtype: torch.dtype
    sensitivity: dict[str, list[float]] | None = None  # tensor -> s per rung (training/sensitivity.py)
    curvature: dict[str, dict] | None = None  # tensor -> {"types", "m"}: fisher.curvature, for the search
    gap: object | None = None  # relaxation.RelaxationGap under --relaxation_gap
    teacher_device: torch.device | None = None
    tp: object | None = None  # parallel.TPContext of a tensor-parallel rank
    tp_plan: object | None = None  # parallel.TPPlan
    tp_sharded: set[str] = field(default_factory=set)  # gated tensors split across ranks
    provenance: dict = field(default_factory=dict)  # Assignment provenance fields (provenance.run_record)
    held_tokens: torch.Tensor | None = None  # sequences held aside from training (guarantee, search)
    confirm_tokens: torch.Tensor | None = None  # held aside too, to check the search's result on (search.confirm)
    references: object | None = None  # guarantee.References: the free assignments to beat
    # (tensor, off-menu type) -> its bytes; a tensor-parallel rank's shard of them (student.ShardedPacked)
    extra_blobs: dict[tuple[str, str], Any] = field(default_factory=dict)
    # (tensor, type) -> sha256 of the candidate bytes this process read (candidate_sources): the
    # assignment records the chosen one's, export checks its bytes against it
    candidate_sha256: dict[tuple[str, str], str] = field(default_factory=dict)
    # the tensors whose menu candidates are error-compensated (those with a Hessian under
    # --error_compensation gptq): with the type, what the assignment records (candidate_is_compensated)
    compensated: frozenset[str] = frozenset()
    # the soft mixtures' outputs, kept across training steps (layers.MixBuffers); cleared when training ends
    mix_buffers: MixBuffers = field(default_factory=MixBuffers)


def hold_aside(tokens: torch.Tensor, n: int, confirm: int = 0
               ) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """(training sequences, the last `n` held aside, the `confirm` before them): never fewer than
    one training sequence, at most a quarter of the file held aside when the file is small (the
    search's split first; the confirmation split gets what is left of that quarter)."""
    if n <= 0 or tokens.shape[0] < 2:
        return tokens, None, None
    total = min(n + max(confirm, 0), max(1, tokens.shape[0] // 4))
    n = min(n, total)
    c = total - n
    return tokens[:-total], tokens[-n:], (tokens[-total:-n] if c > 0 else None)


def plan_run(cfg: TrainConfig, model: nn.Module, imx=None) -> tuple[ArchAdapter, list[TensorPlan], Budget]:
    adapter = adapter_for(getattr(model, "config", None))
    layout_for = _layout_provider(cfg, adapter)
    names = set(imx.entries) if imx is not None else None
    plans = plan_model(model, adapter, cfg.menus, imatrix_names=names, layout_for=layout_for)
    fixed = fixed_tensors(plans, layout_for)  # quantizable, not selectable: counted at the base type
    return adapter, plans, run_budget(cfg, plans, fixed)


def _layout_provider(cfg: TrainConfig, adapter: ArchAdapter):
    """The layout map learned from llama.cpp's converter (GGUF names, rows, permutations)."""
    return converter_layouts(cfg.model)


def build_student(
    cfg: TrainConfig, base: nn.Module, plans: list[TensorPlan], budget: Budget, vectors: dict[str, np.ndarray],
    device: torch.device, dtype: torch.dtype, quantize=None, progress: bool = False,
    init_logits: dict[str, torch.Tensor] | None = None, tp=None, tp_plan=None, hashes: dict | None = None,
) -> dict[str, MixedQuant]:
    """Quantize every candidate (through the cache), attach the gates; returns them by name.
    Under tensor parallelism each MixedQuant holds this rank's shard of every candidate.

    The dense selectable weights are dropped before the model moves to `device` (the candidates
    replace them), so the device never holds the float model; a skeleton's other tensors (norms,
    small projections) are read whole here and split later by :func:`parallel.apply_tp`."""
    reader = reader_of(base)
    params = dict(base.named_parameters(remove_duplicate=False))
    weights = reader_weights(base, plans)
    sources = candidate_sources(plans, weights, vectors, quantize=quantize, progress=progress, hashes=hashes)
    del weights
    planned = {f"{m}.weight" for p in plans for m in p.modules} | {p.name for p in plans}
    for name in planned:  # candidates are quantized from the float32 weights before anything is cast
        set_tensor(base, name, torch.empty(0, dtype=torch.float32))
    if reader is not None:
        materialize(base, [n for n in meta_names(base) if n not in planned],
                     lambda n: reader.get(n, tuple(params[n].shape) if n in params else None))
        del base.voodoo_reader
    owned: dict[int, tuple] = {}  # own copies (tied ones once): a tensor left on a
    for mod in base.modules():  # from_pretrained mmap keeps the whole checkpoint file resident
        for k, t in list(mod._parameters.items()) + list(mod._buffers.items()):
            if t is not None and t.device.type == "cpu" and t.numel():
                if id(t) not in owned:  # the original is kept alive in the entry, so ids stay unique
                    owned[id(t)] = (t, _own(t))
                new = owned[id(t)][1]
                (mod._parameters if k in mod._parameters else mod._buffers)[k] = new
    base.to(device=device, dtype=dtype)
    target_bpw = budget.bpw(budget.train_target_bytes)
    mixed = {
        plan.name: build_mixed(
            plan, sources(plan), lazy=cfg.lazy, dtype=dtype, device=device,
            init_logits=init_logits[plan.name] if init_logits else prior_logits(plan, target_bpw),
            shard=plan_shard(tp_plan, plan), rank=tp.rank if tp else 0, world=tp.world if tp else 1,
        )
        for plan in plans
    }
    attach_all(base, plans, mixed)
    return mixed


def _own(t: torch.Tensor) -> torch.Tensor:
    c = t.detach().clone()
    return nn.Parameter(c, requires_grad=t.requires_grad) if isinstance(t, nn.Parameter) else c


class _ReaderWeights:
    """name -> the tensor read from a skeleton's checkpoint when asked (one at a time)."""

    def __init__(self, reader, shapes: dict[str, tuple[int, ...]]):
        self.reader, self.shapes = reader, shapes

    def __getitem__(self, name: str) -> torch.Tensor:
        return self.reader.get(name, self.shapes[name])

    def lazy(self, name: str):
        return lambda: self[name]


def candidate_sources(plans: list[TensorPlan], weights, vectors: dict[str, np.ndarray], *, quantize=None,
                      progress: bool = False, hashes: dict | None = None):
    """A function plan -> the ggml bytes of its menu rungs, read from the cache one tensor at a
    time (every candidate is built into the cache first unless `quantize` is given). With
    `hashes`, each (tensor, type) read gets the sha256 of its bytes there: the assignment records
    the chosen one's, and export checks what it writes against it."""
    if quantize is not None:
        read = lambda p: candidate_bytes(p, weights[p.name], vectors, quantize)  # noqa: E731
    else:
        report = build_all(_jobs(plans, weights, vectors), CandidateCache(), progress=progress)
        read = lambda p: [report.paths[(p.name, t)].read_bytes() for t in p.menu.types]  # noqa: E731

    def sources(p):
        blobs = read(p)
        if hashes is not None:
            hashes.update({(p.name, t): hashlib.sha256(b).hexdigest() for t, b in zip(p.menu.types, blobs)})
        return blobs
    return sources


def _jobs(plans, weights, vectors):
    """candidate_jobs, with each matrix read only when a job needs it for a reader's weights."""
    if not isinstance(weights, _ReaderWeights):
        return candidate_jobs(plans, weights, vectors)
    jobs = []
    for plan in plans:
        vec = vectors.get(plan.gguf_name) if vectors and plan.gguf_name is not None else None
        comp = compensation_of(vectors, plan.name)
        provider = (lambda lay=plan.layout, get=weights.lazy(plan.name): lay.to_gguf(get()))
        for t in plan.menu.types:
            use = vec if vec is not None and not qt.get(t).is_float else None
            jobs.append(CandidateJob(plan.name, t, provider=provider, imatrix=use, compensation=comp))
    return jobs


def plan_shard(tp_plan, plan: TensorPlan):
    if tp_plan is None:
        return None
    for name in (plan.name, *(f"{m}.weight" for m in plan.modules)):
        sh = tp_plan.shard_of(name)
        if sh is not None:
            return sh
    return None


def extra_candidate_blobs(plans: list[TensorPlan], weights: dict[str, torch.Tensor], vectors: dict[str, np.ndarray],
                          wanted: dict[str, set[str]], *, progress: bool = False, keep=None,
                          hashes: dict | None = None) -> dict[tuple[str, str], Any]:
    """(tensor, type) -> ggml bytes for types off a tensor's menu (the guarantee's references),
    through the same cache, quantizer and imatrix vector as the menu's candidates, but plain: the
    float weights as they are, never error-compensated, so each is exactly the tensor stock
    llama-quantize writes in that type with the same imatrix (``guarantee.py``: a reference stands
    for a file the user gets for free; :func:`candidate_is_compensated`). With `keep` ((plan, type,
    bytes) -> what to hold), what it makes of each as it is read (a rank's shard)."""
    jobs = []
    for p in plans:
        types = sorted(set(wanted.get(p.name, ())) - set(p.menu.types))  # a menu type's bytes are the run's candidate
        if not types:
            continue
        w = weights[p.name]
        vec = vectors.get(p.gguf_name) if p.gguf_name is not None else None
        provider = (lambda lay=p.layout, w=w: lay.to_gguf(w))
        for t in types:  # compensation=None: keyed in the cache apart from a compensated candidate
            jobs.append(CandidateJob(p.name, t, provider=provider, imatrix=None if qt.get(t).is_float else vec))
    if not jobs:
        return {}
    report = build_all(jobs, CandidateCache(), progress=progress)
    by = {p.name: p for p in plans}
    keep = keep or (lambda plan, qtype, blob: blob)
    out = {}
    for j in jobs:
        blob = report.paths[(j.name, j.qtype)].read_bytes()
        if hashes is not None:
            hashes[(j.name, j.qtype)] = hashlib.sha256(blob).hexdigest()
        out[(j.name, j.qtype)] = keep(by[j.name], j.qtype, blob)
    return out


def candidate_is_compensated(plan: TensorPlan, qtype: str, compensated: set[str] | frozenset[str]) -> bool:
    """Whether the run's bytes of tensor `plan` in `qtype` are error-compensated: a quantized type
    on its menu of a tensor the run compensates (`compensated`: the tensors with a Hessian); a
    reference's off-menu type never is (:func:`extra_candidate_blobs`). The assignment records it
    per tensor, and export writes those bytes, not the compensated ones."""
    return plan.name in compensated and qtype in plan.menu.types and applies(qtype)


def candidate_blobs(plans: list[TensorPlan], weights: dict[str, torch.Tensor], vectors: dict[str, np.ndarray],
                    *, quantize=None, progress: bool = False) -> dict[str, list[bytes]]:
    """tensor -> the ggml bytes of every menu rung (through the on-disk cache unless `quantize`),
    all held at once; :func:`candidate_sources` reads them one tensor at a time."""
    sources = candidate_sources(plans, weights, vectors, quantize=quantize, progress=progress)
    return {p.name: sources(p) for p in plans}
