"""Everything a run needs before its first step: data, models, imatrix, plans, budget, gates."""

from __future__ import annotations

import copy
import logging
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from .. import envs, fileio, ggml
from ..arch import adapter_for
from ..arch.base import ArchAdapter
from ..budget import Budget, make_budget
from ..errors import ConfigError, CorruptFileError
from ..layers import MixedQuant
from ..student import (
    TensorPlan, attach_all, build_mixed, candidate_bytes, fixed_tensors, plan_model, prior_logits, selectable_weights,
)
from .config import TrainConfig

log = logging.getLogger(__name__)

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


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


def load_models(cfg: TrainConfig, dtype: torch.dtype, *, sharded: bool = False) -> tuple[nn.Module, nn.Module]:
    """(student base, frozen teacher), both in eval mode on the CPU.

    With `sharded` (a tensor-parallel rank, or one process with ``--lazy``) both are skeletons
    (:mod:`voodoo_quant.lazyload`):
    no weight is read here; :func:`build_student` streams the student's tensors one at a time into
    the candidate cache and keeps only this rank's shards, and :func:`shard_teacher` reads only the
    teacher's shards. Host memory is then one full tensor plus this rank's part of the model.
    Loaded whole, a float teacher shares the base's float32 tensors (:func:`float_teacher`): one
    float32 model, not two."""
    if sharded and can_load_sharded(cfg):
        return _skeletons(cfg)
    from ..modeling import load_model

    from .teacher_q8 import pack_teacher, packs_teacher

    base = load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        _load_into(base, cfg.base_checkpoint, "base checkpoint")
    for p in base.parameters():
        p.requires_grad_(False)
    if not (cfg.teacher_checkpoint or cfg.teacher_quant or cfg.tensor_parallel > 1):
        return base.eval(), float_teacher(base, dtype).eval()
    teacher = copy.deepcopy(base)
    # --lazy with a Q8_0 teacher: its selectable weights held packed (training/teacher_q8.py); a
    # tensor-parallel rank that loads whole packs nothing (apply_tp splits dense weights)
    pack = packs_teacher(cfg) and cfg.tensor_parallel == 1
    entries: dict = {}
    if cfg.teacher_checkpoint:
        entries = _load_into(teacher, cfg.teacher_checkpoint, "teacher checkpoint", q8_entries=pack)
    elif cfg.teacher_quant == "Q8_0":
        entries = _quantize_teacher_q8(teacher, keep_entries=pack)
    if entries:
        pack_teacher(teacher, entries, dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return base.eval(), teacher.to(dtype).eval()


def float_teacher(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The float teacher without a second float32 copy of the model: a structural copy of `base`
    whose floating tensors are `base`'s own in float32 (shared: :func:`build_student` replaces the
    student's by candidates and own copies rather than writing them; the measured sensitivity pass
    writes rungs in place before training and puts every weight back bit for bit) or cast straight
    to `dtype`. Not for a teacher whose weights are then changed in place (Q8_0, a teacher
    checkpoint) or split in place (tensor parallelism loaded whole): those deep-copy."""
    memo = {}
    for t in list(base.parameters()) + list(base.buffers()):
        if id(t) in memo:
            continue
        if not t.is_floating_point() or t.dtype == dtype:
            memo[id(t)] = t
        elif isinstance(t, nn.Parameter):
            memo[id(t)] = nn.Parameter(t.detach().to(dtype), requires_grad=False)
        else:
            memo[id(t)] = t.to(dtype)
    return copy.deepcopy(base, memo)


def can_load_sharded(cfg: TrainConfig) -> bool:
    """Sharded loading reads safetensors (and .pt checkpoints) by name; a GGUF source loads whole."""
    return Path(cfg.model).is_dir() and any(Path(cfg.model).glob("*.safetensors"))


def _skeletons(cfg: TrainConfig) -> tuple[nn.Module, nn.Module]:
    from ..lazyload import WeightReader, text_skeleton

    base = text_skeleton(cfg.model, cfg.text_model_class)
    teacher = text_skeleton(cfg.model, cfg.text_model_class)
    base.voodoo_reader = WeightReader(cfg.model, base, checkpoint=cfg.base_checkpoint)
    tsrc = cfg.teacher_checkpoint or cfg.base_checkpoint
    teacher.voodoo_reader = WeightReader(cfg.model, teacher, checkpoint=tsrc)
    teacher.voodoo_q8 = cfg.teacher_quant == "Q8_0" and not cfg.teacher_checkpoint
    teacher.voodoo_pack = cfg.lazy and (teacher.voodoo_q8 or teacher.voodoo_reader.is_teacher)  # teacher_q8.py
    teacher.voodoo_dtype = TORCH_DTYPES[cfg.dtype]  # each shard is cast as it is read
    return base, teacher


def reader_of(model: nn.Module):
    """The :class:`~voodoo_quant.lazyload.WeightReader` of a skeleton, else None (a loaded model)."""
    return getattr(model, "voodoo_reader", None)


def sensitivity_model(cfg: TrainConfig, base: nn.Module, tp=None) -> nn.Module:
    """The float model the sensitivity pass reads: `base`, loaded or a skeleton (the Fisher pass
    then reads it one decoder layer at a time: training/layerwise.py). The output-error table
    (``--sensitivity_kind output``) needs the loaded model: a skeleton's rank 0 loads it whole
    (the others read the saved table)."""
    if reader_of(base) is None or (tp is not None and not tp.is_main) or cfg.sensitivity_kind == "fisher":
        return base
    from ..modeling import load_model

    full = load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        _load_into(full, cfg.base_checkpoint, "base checkpoint")
    return full


def reader_weights(model: nn.Module, plans):
    """name -> float weight of every planned tensor: a loaded model's own, or for a skeleton read
    from its checkpoint one at a time when asked."""
    reader = reader_of(model)
    if reader is not None:
        return _ReaderWeights(reader, {p.name: p.shape for p in plans})
    return {n: w for n, (w, _) in selectable_weights(model).items()}


def _materialize(model: nn.Module, names, read) -> None:
    from ..lazyload import set_tensor

    for name in names:
        set_tensor(model, name, read(name))


def shard_teacher(teacher: nn.Module, tp_plan, tp) -> None:
    """Split the teacher for this rank: a loaded teacher by :func:`parallel.apply_tp`; a skeleton
    by reading only its shard of every split tensor (a Q8_0 teacher's selectable weights are
    rounded through ggml's Q8_0 first: on the shard's rows directly, as Q8_0 works row by row, or
    on the whole tensor when the split cuts the rows). With `tp` None (one process, ``--lazy``) a
    skeleton reads every tensor whole, the same way."""
    from ..lazyload import meta_names
    from ..parallel import apply_tp

    reader = reader_of(teacher)
    if reader is None:
        if tp is not None:
            apply_tp(teacher, tp_plan, tp)
        return

    def shard_of(name: str):
        return tp_plan.shard_of(name) if tp_plan is not None else None
    selectable = {n for n, _ in selectable_weights(teacher).items()}
    q8 = getattr(teacher, "voodoo_q8", False)
    params = dict(teacher.named_parameters(remove_duplicate=False))

    def read(name: str) -> torch.Tensor:
        shape = tuple(params[name].shape) if name in params else None
        sh = shard_of(name)
        if sh is None:
            return _q8(reader.get(name, shape), name) if q8 and name in selectable else reader.get(name, shape)
        if q8 and name in selectable:
            if sh.dim == 0:
                return _q8(reader.get_shard(name, 0, sh.bounds(tp.rank, tp.world), shape), name)
            return sh.take(_q8(reader.get(name, shape), name), tp.rank, tp.world)
        return reader.get_shard(name, sh.dim, sh.bounds(tp.rank, tp.world), shape)

    dtype = getattr(teacher, "voodoo_dtype", torch.float32)
    names = meta_names(teacher)
    entries = {}
    if getattr(teacher, "voodoo_pack", False):  # --lazy: this rank's Q8_0 blocks, kept packed
        for n in names:
            if n in selectable and (e := _q8_shard_entry(reader, n, params, shard_of(n), tp)) is not None:
                entries[n] = e
    _materialize(teacher, [n for n in names if n not in entries], lambda n: read(n).to(dtype))
    if entries:
        from .teacher_q8 import pack_teacher

        pack_teacher(teacher, entries, dtype)
    teacher.to(dtype)  # its float buffers too, as the whole-model path's teacher.to(dtype) does
    if tp is not None:  # every split tensor is already this rank's part: apply_tp only adds the collectives
        apply_tp(teacher, tp_plan, tp, gated=set(tp_plan.params))
    del teacher.voodoo_reader


def _q8_shard_entry(reader, name: str, params, sh, tp):
    """This rank's Q8_0 entry of selectable weight `name` (training/teacher_q8.py): rows or whole
    blocks of a teacher checkpoint's entry, or of the float weight quantized like :func:`_q8`
    (a row shard directly, a column shard from the whole tensor); None where the row length
    falls back to F16 or the split cuts Q8_0 blocks (that shard stays dense)."""
    from ..checkpoints import teacher_entry
    from .teacher_q8 import is_q8_entry, shard_entry

    shape = tuple(params[name].shape) if name in params else None
    e = reader.entry(name)
    if e is None:  # a float source: quantize as _q8 does
        if sh is not None and sh.dim == 0:
            e = teacher_entry(name, reader.get_shard(name, 0, sh.bounds(tp.rank, tp.world), shape))
            return e if is_q8_entry(e) else None
        e = teacher_entry(name, reader.get(name, shape))
    if not is_q8_entry(e):
        return None
    return dict(e) if sh is None else shard_entry(e, sh, tp.rank, tp.world)


def _q8(w: torch.Tensor, name: str) -> torch.Tensor:
    """`w` through llama.cpp-exact Q8_0 (fallback applied), row by row (rows of its last dim)."""
    from .. import qtypes as qt

    lib = ggml.lib()
    m = np.ascontiguousarray(w.detach().float().reshape(-1, w.shape[-1]).numpy())
    q = qt.resolve_for_row("Q8_0", m.shape[1])
    return torch.from_numpy(lib.dequantize(lib.quantize(m, q, name=name), q, m.shape, name=name)).reshape(w.shape)


def _load_into(model: nn.Module, path: str, what: str, *, q8_entries: bool = False) -> dict:
    """Load a plain state dict, a make-teacher base (``voodoo-base/1``) or teacher
    (``voodoo-teacher/1``, packed Q8_0) into `model`, checking names and shapes first. With
    `q8_entries`, returns a teacher's packed Q8_0 entries of the selectable weights (to be held
    packed, training/teacher_q8.py); else {}."""
    from ..checkpoints import TEACHER_FORMAT, load_teacher
    from .teacher_q8 import is_q8_entry

    obj = fileio.torch_load(path, what=what)
    entries = {}
    if isinstance(obj, dict) and obj.get("format") == TEACHER_FORMAT:
        if q8_entries:
            entries = {n: obj["tensors"][n] for n in selectable_weights(model)
                       if is_q8_entry(obj["tensors"].get(n))}
        obj = load_teacher(path)[0]
    sd = obj.get("state_dict", obj) if isinstance(obj, dict) else obj
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CorruptFileError(f"{what} {path} is not a state dict of tensors")
    own = model.state_dict()
    missing = [k for k in own if k not in sd and not k.endswith("lm_head.weight")]
    unexpected = [k for k in sd if k not in own]
    if missing or unexpected:
        raise CorruptFileError(f"{what} {path} does not fit the model: missing {missing[:3]}, unexpected {unexpected[:3]}")
    for k, v in sd.items():
        if tuple(v.shape) != tuple(own[k].shape):
            raise CorruptFileError(f"{what} {path}: {k} has shape {tuple(v.shape)}, model has {tuple(own[k].shape)}")
    model.load_state_dict({k: v.to(own[k].dtype) for k, v in sd.items()}, strict=False)
    return entries


def _quantize_teacher_q8(model: nn.Module, *, keep_entries: bool = False) -> dict:
    """Replace every selectable weight by its llama.cpp-exact Q8_0 round trip (fallback applied).
    With `keep_entries`, the Q8_0 blocks of the weights that quantize to Q8_0 are returned
    instead (to be held packed: the same values, training/teacher_q8.py)."""
    from ..checkpoints import teacher_entry
    from .teacher_q8 import is_q8_entry

    entries = {}
    for name, (w, _) in selectable_weights(model).items():
        if keep_entries and is_q8_entry(e := teacher_entry(name, w.detach())):
            entries[name] = e
            continue
        with torch.no_grad():
            w.copy_(_q8(w, name).to(w.dtype))
    return entries


def load_imatrix(cfg: TrainConfig):
    if not cfg.imatrix:
        return None
    from .. import imatrix as im

    return im.load(cfg.imatrix)


def imatrix_vectors(imx, plans_or_layouts) -> dict[str, np.ndarray]:
    """GGUF name -> the quantizer's vector, for every planned tensor the imatrix covers."""
    if imx is None:
        return {}
    out = {}
    for p in plans_or_layouts:
        if p.gguf_name is not None:
            v = imx.get_vector(p.gguf_name, p.n_per_row)
            if v is not None:
                out[p.gguf_name] = v
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
    references: object | None = None  # guarantee.References: the free assignments to beat
    extra_blobs: dict[tuple[str, str], bytes] = field(default_factory=dict)  # (tensor, off-menu type) -> bytes


def hold_aside(tokens: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(training sequences, the last `n` held aside): never fewer than one training sequence,
    at most a quarter of the file held aside when the file is small."""
    if n <= 0 or tokens.shape[0] < 2:
        return tokens, None
    n = min(n, max(1, tokens.shape[0] // 4))
    return tokens[:-n], tokens[-n:]


def plan_run(cfg: TrainConfig, model: nn.Module, imx=None) -> tuple[ArchAdapter, list[TensorPlan], Budget]:
    adapter = adapter_for(getattr(model, "config", None))
    layout_for = _layout_provider(cfg, adapter)
    names = set(imx.entries) if imx is not None else None
    plans = plan_model(model, adapter, cfg.menus, imatrix_names=names, layout_for=layout_for)
    budget = make_budget(
        plans,
        compression_ratio=cfg.compression_ratio,
        target_bits=cfg.target_bits,
        budget_reduction=cfg.budget_reduction,
        tolerance=cfg.size_tolerance,
        fixed=fixed_tensors(plans, layout_for),  # quantizable, not selectable: counted at the base type
    )
    return adapter, plans, budget


def _layout_provider(cfg: TrainConfig, adapter: ArchAdapter):
    """The layout map learned from llama.cpp's converter (GGUF names, rows, permutations)."""
    from ..student import converter_layouts

    return converter_layouts(cfg.model)


def build_student(
    cfg: TrainConfig, base: nn.Module, plans: list[TensorPlan], budget: Budget, vectors: dict[str, np.ndarray],
    device: torch.device, dtype: torch.dtype, quantize=None, progress: bool = False,
    init_logits: dict[str, torch.Tensor] | None = None, tp=None, tp_plan=None,
) -> dict[str, MixedQuant]:
    """Quantize every candidate (through the cache), attach the gates; returns them by name.
    Under tensor parallelism each MixedQuant holds this rank's shard of every candidate.

    The dense selectable weights are dropped before the model moves to `device` (the candidates
    replace them), so the device never holds the float model; a skeleton's other tensors (norms,
    small projections) are read whole here and split later by :func:`parallel.apply_tp`."""
    from ..lazyload import meta_names, set_tensor

    reader = reader_of(base)
    params = dict(base.named_parameters(remove_duplicate=False))
    weights = reader_weights(base, plans)
    sources = candidate_sources(plans, weights, vectors, quantize=quantize, progress=progress)
    del weights
    planned = {f"{m}.weight" for p in plans for m in p.modules} | {p.name for p in plans}
    for name in planned:  # candidates are quantized from the float32 weights before anything is cast
        set_tensor(base, name, torch.empty(0, dtype=torch.float32))
    if reader is not None:
        _materialize(base, [n for n in meta_names(base) if n not in planned],
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
                      progress: bool = False):
    """A function plan -> the ggml bytes of its menu rungs, read from the cache one tensor at a
    time (every candidate is built into the cache first unless `quantize` is given)."""
    from ..cache import CandidateCache
    from ..precache import build_all

    if quantize is not None:
        return lambda p: candidate_bytes(p, weights[p.name], vectors, quantize)
    report = build_all(_jobs(plans, weights, vectors), CandidateCache(), progress=progress)
    return lambda p: [report.paths[(p.name, t)].read_bytes() for t in p.menu.types]


def _jobs(plans, weights, vectors):
    """candidate_jobs, with each matrix read only when a job needs it for a reader's weights."""
    from .. import qtypes as qt
    from ..precache import CandidateJob
    from ..student import candidate_jobs

    if not isinstance(weights, _ReaderWeights):
        return candidate_jobs(plans, weights, vectors)
    jobs = []
    for plan in plans:
        vec = vectors.get(plan.gguf_name) if vectors and plan.gguf_name is not None else None
        provider = (lambda lay=plan.layout, get=weights.lazy(plan.name): lay.to_gguf(get()))
        for t in plan.menu.types:
            use = vec if vec is not None and not qt.get(t).is_float else None
            jobs.append(CandidateJob(plan.name, t, provider=provider, imatrix=use))
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
                          wanted: dict[str, set[str]], *, progress: bool = False) -> dict[tuple[str, str], bytes]:
    """(tensor, type) -> ggml bytes for types off a tensor's menu (the guarantee's references),
    through the same cache, quantizer and imatrix vector as the menu's candidates."""
    from .. import qtypes as qt
    from ..cache import CandidateCache
    from ..precache import CandidateJob, build_all

    jobs = []
    for p in plans:
        types = sorted(wanted.get(p.name, ()))
        if not types:
            continue
        w = weights[p.name]
        vec = vectors.get(p.gguf_name) if p.gguf_name is not None else None
        provider = (lambda lay=p.layout, w=w: lay.to_gguf(w))
        for t in types:
            jobs.append(CandidateJob(p.name, t, provider=provider, imatrix=None if qt.get(t).is_float else vec))
    if not jobs:
        return {}
    report = build_all(jobs, CandidateCache(), progress=progress)
    return {(j.name, j.qtype): report.paths[(j.name, j.qtype)].read_bytes() for j in jobs}


def candidate_blobs(plans: list[TensorPlan], weights: dict[str, torch.Tensor], vectors: dict[str, np.ndarray],
                    *, quantize=None, progress: bool = False) -> dict[str, list[bytes]]:
    """tensor -> the ggml bytes of every menu rung (through the on-disk cache unless `quantize`),
    all held at once; :func:`candidate_sources` reads them one tensor at a time."""
    sources = candidate_sources(plans, weights, vectors, quantize=quantize, progress=progress)
    return {p.name: sources(p) for p in plans}
