"""A Q8_0 teacher held as its packed Q8_0 blocks on the device, dequantized per layer on use.

A Q8_0 teacher (``--teacher_quant Q8_0``, or a ``voodoo-teacher/1`` checkpoint from ``voodoo
make-teacher``) is, weight for weight, ``d * qs`` in float32 (``checkpoints.entry_to_float``,
exactly ggml's ``dequantize_row_q8_0``) cast to the training dtype. Under ``--lazy`` the trainer
keeps each selectable weight of such a teacher as its int8 ``qs`` and fp16 ``d`` (8.5 bits per
weight instead of 16 in bf16) and rebuilds the dense weight when its layer runs: a Linear's
``weight`` is a property that dequantizes (block of rows by block of rows, into the training
dtype, so the transient is the layer's weight, not a float32 copy of it), an Embedding gathers
and dequantizes only the looked-up rows. The values are those of the dense teacher made from
the same Q8_0 weights, so its logits are the same (tests/test_teacher_q8.py).

Rows that are not a multiple of 32 (llama-quantize's F16 fallback) and tensor-parallel splits
that cut Q8_0 blocks stay dense, as before.
"""

from __future__ import annotations

from typing import Any, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from ..model.checkpoints import TEACHER_FORMAT
from ..student.layers import chunk_rows

BLOCK = 32  # weights per Q8_0 block (ggml-common.h QK8_0)
_CLASSES: dict[type, type] = {}


def is_q8_entry(e: Any) -> bool:
    return isinstance(e, dict) and e.get("type") == "Q8_0"


def shard_entry(e: Mapping[str, Any], shard, rank: int, world: int) -> dict[str, Any] | None:
    """Rank `rank`'s part of a Q8_0 entry along `shard` (whole rows, or whole blocks of every
    row); None when the split cuts a Q8_0 block (the caller keeps that shard dense)."""
    qs, d = e["qs"], e["d"]
    bounds = shard.bounds(rank, world)
    if shard.dim == 0:
        return {"type": "Q8_0", "qs": torch.cat([qs[lo:hi] for lo, hi in bounds]).contiguous(),
                "d": torch.cat([d[lo:hi] for lo, hi in bounds]).contiguous()}
    if shard.dim != 1 or any(lo % BLOCK or hi % BLOCK for lo, hi in bounds):
        return None
    return {"type": "Q8_0", "qs": torch.cat([qs[:, lo:hi] for lo, hi in bounds], 1).contiguous(),
            "d": torch.cat([d[:, lo // BLOCK:hi // BLOCK] for lo, hi in bounds], 1).contiguous()}


def dequantize(qs: torch.Tensor, d16: torch.Tensor, dtype: torch.dtype, block_rows: int | None = None) -> torch.Tensor:
    """``d * qs`` in float32 (as ``checkpoints.entry_to_float``), cast to `dtype`, computed a block
    of rows at a time into the output (each element by the same operations: the same values)."""
    rows, cols = qs.shape
    step = block_rows or chunk_rows((rows, cols))
    out = torch.empty((rows, cols), dtype=dtype, device=qs.device)
    for lo in range(0, rows, step):
        hi = min(rows, lo + step)
        w = qs[lo:hi].to(torch.float32).reshape(hi - lo, cols // BLOCK, BLOCK) * d16[lo:hi].to(torch.float32).unsqueeze(-1)
        out[lo:hi].copy_(w.reshape(hi - lo, cols))
    return out


def _dense_weight(self) -> torch.Tensor:
    return dequantize(self.q8_qs, self.q8_d.view(torch.float16), self.q8_dtype)


def _embedding_forward(self, input: torch.Tensor) -> torch.Tensor:
    if self.max_norm is not None:  # renormalizes rows in place: needs the dense weight
        return F.embedding(input, self.weight, self.padding_idx, self.max_norm, self.norm_type,
                           self.scale_grad_by_freq, self.sparse)
    flat = input.reshape(-1)
    w = dequantize(self.q8_qs.index_select(0, flat), self.q8_d.view(torch.float16).index_select(0, flat), self.q8_dtype)
    return w.reshape(*input.shape, w.shape[-1])


def _packed_class(cls: type) -> type:
    if cls not in _CLASSES:
        attrs: dict[str, Any] = {"weight": property(_dense_weight), "__module__": __name__}
        if issubclass(cls, nn.Embedding) and cls.forward is nn.Embedding.forward:
            attrs["forward"] = _embedding_forward  # a subclass's own forward (scaling) reads .weight
        _CLASSES[cls] = type(f"PackedQ8{cls.__name__}", (cls,), attrs)
    return _CLASSES[cls]


def is_packed(mod: nn.Module) -> bool:
    return type(mod) in _CLASSES.values()


def pack_module(mod: nn.Module, qs: nn.Parameter, d: nn.Parameter, dtype: torch.dtype) -> None:
    """Make `mod` (a Linear or Embedding) serve its weight from packed Q8_0 `qs` / `d` (int8 and
    the fp16 scales' bits as int16, so ``module.to(dtype)`` leaves both alone)."""
    del mod._parameters["weight"]
    mod.__class__ = _packed_class(type(mod))
    mod._parameters["q8_qs"] = qs
    mod._parameters["q8_d"] = d
    mod.q8_dtype = dtype


def pack_teacher(model: nn.Module, entries: Mapping[str, Mapping[str, Any]], dtype: torch.dtype) -> int:
    """Pack every weight of `model` named in `entries` (name -> a Q8_0 entry of that weight's
    values, this rank's part under tensor parallelism) on each module that uses it (a tied
    embedding / LM head shares one packed copy). Returns the packed bytes."""
    total = 0
    for name, e in entries.items():
        mname, _, pname = name.rpartition(".")
        owner = model.get_submodule(mname)
        if pname != "weight" or not isinstance(owner, (nn.Linear, nn.Embedding)) or is_packed(owner):
            continue
        old = owner._parameters["weight"]
        users = [m for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))
                 and m._parameters.get("weight") is old]
        qs = nn.Parameter(e["qs"].to(torch.int8).contiguous(), requires_grad=False)
        d = nn.Parameter(e["d"].to(torch.float16).contiguous().view(torch.int16), requires_grad=False)
        if qs.dim() != 2 or qs.shape[1] != BLOCK * d.shape[1] or qs.shape[0] != d.shape[0]:
            raise ValueError(f"{name}: malformed Q8_0 entry (qs {tuple(qs.shape)}, d {tuple(d.shape)})")
        for m in users:
            pack_module(m, qs, d, dtype)
        total += qs.numel() + 2 * d.numel()
    return total


def packed_bytes(model: nn.Module) -> int:
    seen: set[int] = set()
    n = 0
    for m in model.modules():
        if is_packed(m) and id(m.q8_qs) not in seen:
            seen.add(id(m.q8_qs))
            n += m.q8_qs.numel() + 2 * m.q8_d.numel()
    return n


def packs_teacher(cfg) -> bool:
    """Whether a run holds its teacher packed: ``--lazy`` with a Q8_0 teacher (``--teacher_quant
    Q8_0`` or a ``voodoo-teacher/1`` checkpoint)."""
    if not cfg.lazy:
        return False
    if cfg.teacher_checkpoint:
        return teacher_checkpoint_is_q8(cfg.teacher_checkpoint)
    return cfg.teacher_quant == "Q8_0"


def teacher_checkpoint_is_q8(path) -> bool:
    from pathlib import Path

    if not Path(path).is_file():
        return False
    try:
        obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 - not a checkpoint this module reads; the loader reports it
        return False
    return isinstance(obj, dict) and obj.get("format") == TEACHER_FORMAT
