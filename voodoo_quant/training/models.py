"""The two models a run distils between: the student's base and the frozen teacher.

Loaded whole (a float teacher shares the base's float32 tensors: :func:`float_teacher`; a Q8_0
or checkpoint teacher is its own copy) or as skeletons that read their tensors one at a time
(:mod:`voodoo_quant.model.lazyload`), and the teacher split for a tensor-parallel rank
(:func:`shard_teacher`). What the run builds from them (plans, budget, gates) is in
:mod:`.setup`."""

from __future__ import annotations

import copy
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn

from ..core import fileio, ggml
from ..core import qtypes as qt
from ..core.errors import CorruptFileError
from ..distributed.parallel import apply_tp
from ..model import modeling
from ..model.checkpoints import TEACHER_FORMAT, load_teacher, teacher_entry
from ..model.lazyload import WeightReader, meta_names, set_tensor, text_skeleton
from ..student.build import selectable_weights
from .config import TrainConfig
from .teacher_q8 import is_q8_entry, pack_teacher, packs_teacher, shard_entry

TORCH_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def load_models(cfg: TrainConfig, dtype: torch.dtype, *, sharded: bool = False) -> tuple[nn.Module, nn.Module]:
    """(student base, frozen teacher), both in eval mode on the CPU.

    With `sharded` (a tensor-parallel rank, or one process with ``--lazy``) both are skeletons
    (:mod:`voodoo_quant.model.lazyload`): no weight is read here; ``setup.build_student`` streams the
    student's tensors one at a time into the candidate cache and keeps only this rank's shards,
    and :func:`shard_teacher` reads only the teacher's shards. Host memory is then one full tensor plus this rank's part of the model.
    Loaded whole, a float teacher shares the base's float32 tensors (:func:`float_teacher`): one
    float32 model, not two."""
    if sharded and can_load_sharded(cfg):
        return _skeletons(cfg)
    base = modeling.load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        load_into(base, cfg.base_checkpoint, "base checkpoint")
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
        entries = load_into(teacher, cfg.teacher_checkpoint, "teacher checkpoint", q8_entries=pack)
    elif cfg.teacher_quant == "Q8_0":
        entries = _quantize_teacher_q8(teacher, keep_entries=pack)
    if entries:
        pack_teacher(teacher, entries, dtype)
    for p in teacher.parameters():
        p.requires_grad_(False)
    return base.eval(), teacher.to(dtype).eval()


def float_teacher(base: nn.Module, dtype: torch.dtype) -> nn.Module:
    """The float teacher without a second float32 copy of the model: a structural copy of `base`
    whose floating tensors are `base`'s own in float32 (shared: ``setup.build_student`` replaces
    the student's by candidates and own copies rather than writing them; the measured sensitivity pass
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
    """The :class:`~voodoo_quant.model.lazyload.WeightReader` of a skeleton, else None (a loaded model)."""
    return getattr(model, "voodoo_reader", None)


def sensitivity_model(cfg: TrainConfig, base: nn.Module, tp=None) -> nn.Module:
    """The float model the sensitivity pass reads: `base`, loaded or a skeleton (the Fisher pass
    then reads it one decoder layer at a time: training/layerwise.py). The output-error table
    (``--sensitivity_kind output``) needs the loaded model: a skeleton's rank 0 loads it whole
    (the others read the saved table)."""
    if reader_of(base) is None or (tp is not None and not tp.is_main) or cfg.sensitivity_kind == "fisher":
        return base
    full = modeling.load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        load_into(full, cfg.base_checkpoint, "base checkpoint")
    return full


def materialize(model: nn.Module, names, read) -> None:
    for name in names:
        set_tensor(model, name, read(name))


def shard_teacher(teacher: nn.Module, tp_plan, tp) -> None:
    """Split the teacher for this rank: a loaded teacher by :func:`parallel.apply_tp`; a skeleton
    by reading only its shard of every split tensor (a Q8_0 teacher's selectable weights are
    rounded through ggml's Q8_0 first: on the shard's rows directly, as Q8_0 works row by row, or
    on the whole tensor when the split cuts the rows). With `tp` None (one process, ``--lazy``) a
    skeleton reads every tensor whole, the same way."""
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
    materialize(teacher, [n for n in names if n not in entries], lambda n: read(n).to(dtype))
    if entries:
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
    lib = ggml.lib()
    m = np.ascontiguousarray(w.detach().float().reshape(-1, w.shape[-1]).numpy())
    q = qt.resolve_for_row("Q8_0", m.shape[1])
    return torch.from_numpy(lib.dequantize(lib.quantize(m, q, name=name), q, m.shape, name=name)).reshape(w.shape)


def load_into(model: nn.Module, path: str, what: str, *, q8_entries: bool = False) -> dict:
    """Load a plain state dict, a make-teacher base (``voodoo-base/1``) or teacher
    (``voodoo-teacher/1``, packed Q8_0) into `model`, checking names and shapes first. With
    `q8_entries`, returns a teacher's packed Q8_0 entries of the selectable weights (to be held
    packed, training/teacher_q8.py); else {}."""
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
    entries = {}
    for name, (w, _) in selectable_weights(model).items():
        if keep_entries and is_q8_entry(e := teacher_entry(name, w.detach())):
            entries[name] = e
            continue
        with torch.no_grad():
            w.copy_(_q8(w, name).to(w.dtype))
    return entries
