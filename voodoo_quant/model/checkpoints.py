"""The checkpoint formats ``voodoo make-teacher`` writes, read by the trainer, eval and tests.

- ``voodoo-base/1``: ``{"format", "state_dict", "source", "model_class", "config_json", ...}``,
  the text model's state dict in its dtype;
- ``voodoo-teacher/1``: ``{"format", "tensors", ...}``, every 2-D weight as llama-quantize would
  store it in a Q8_0 file: Q8_0 blocks from libggml-base kept packed (int8 ``qs`` + fp16 scale
  ``d`` per 32 weights; ``d * qs`` in float32 is exactly ggml's ``dequantize_row_q8_0``), F16 for
  rows that are not a multiple of 32 (llama-quantize's fallback, ``src/llama-quant.cpp``), F32
  for 1-D tensors.

A core module: the trainer (``training/setup.py``) and the tools read these files through it;
``tools/teacher.py`` writes them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..core import fileio, ggml
from ..core import qtypes as qt
from ..core.errors import CorruptFileError
from .modeling import model_from_state_dict

BASE_FORMAT = "voodoo-base/1"
TEACHER_FORMAT = "voodoo-teacher/1"

_Q8_0_BLOCK = np.dtype([("d", "<f2"), ("qs", "i1", (32,))])  # block_q8_0, ggml-common.h


def teacher_entry(name: str, w) -> dict[str, Any]:
    """One tensor of the teacher, as llama-quantize would store it in a Q8_0 file."""
    import torch

    if w.ndim != 2:
        return {"type": "F32", "data": w.to(torch.float32).contiguous()}
    q = qt.resolve_for_row("Q8_0", int(w.shape[1]))
    if q.name == "F16":
        return {"type": "F16", "data": w.to(torch.float16).contiguous()}
    rows, cols = w.shape
    raw = ggml.lib().quantize(np.ascontiguousarray(w.to(torch.float32).numpy()), "Q8_0", name=name)
    blocks = np.frombuffer(raw, dtype=_Q8_0_BLOCK).reshape(rows, cols // 32)
    return {
        "type": "Q8_0",
        "d": torch.from_numpy(blocks["d"].copy()),
        "qs": torch.from_numpy(blocks["qs"].reshape(rows, cols).copy()),
    }


def entry_to_float(entry: dict[str, Any]):
    """float32 values of a teacher tensor; for Q8_0 exactly ggml's dequantize_row_q8_0."""
    import torch

    if entry["type"] == "Q8_0":
        qs, d = entry["qs"], entry["d"]
        rows, cols = qs.shape
        w = qs.to(torch.float32).reshape(rows, cols // 32, 32) * d.to(torch.float32).unsqueeze(-1)
        return w.reshape(rows, cols)
    if entry["type"] in ("F16", "F32"):
        return entry["data"].to(torch.float32)
    raise CorruptFileError(f"unknown teacher tensor type {entry['type']!r}")


def load_teacher(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(float32 state dict, header) of a teacher ``.pt`` written by :func:`make_teacher`."""
    obj = fileio.torch_load(path, what="teacher checkpoint")
    if not isinstance(obj, dict) or obj.get("format") != TEACHER_FORMAT:
        raise CorruptFileError(f"{path} is not a voodoo teacher checkpoint ({TEACHER_FORMAT})")
    sd = {k: entry_to_float(e) for k, e in obj["tensors"].items()}
    return sd, {k: v for k, v in obj.items() if k != "tensors"}


def load_base(path: str | Path) -> tuple[dict[str, Any], dict[str, Any]]:
    """(state dict, header) of a base ``.pt`` written by :func:`make_teacher`."""
    obj = fileio.torch_load(path, what="base checkpoint")
    if not isinstance(obj, dict) or obj.get("format") != BASE_FORMAT:
        raise CorruptFileError(f"{path} is not a voodoo base checkpoint ({BASE_FORMAT})")
    return obj["state_dict"], {k: v for k, v in obj.items() if k != "state_dict"}


def module_from_checkpoint(path: str | Path, dtype: Any = None):
    """The causal LM of a base or teacher ``.pt`` (teacher: its exact Q8_0 values, float32)."""
    import json

    import torch
    import transformers

    obj = fileio.torch_load(path, what="checkpoint")
    fmt = obj.get("format") if isinstance(obj, dict) else None
    if fmt == TEACHER_FORMAT:
        sd, header = load_teacher(path)
    elif fmt == BASE_FORMAT:
        sd, header = load_base(path)
    else:
        raise CorruptFileError(f"{path} is neither a voodoo base nor a teacher checkpoint")
    cls = getattr(transformers, header["model_class"], None)
    if cls is None:
        raise CorruptFileError(f"{path}: model class {header['model_class']!r} is not in this transformers")
    config = cls.config_class.from_dict(json.loads(header["config_json"]))
    return model_from_state_dict(cls, config, sd, dtype=dtype or torch.float32)
