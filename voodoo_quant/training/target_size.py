"""``--target_size``: the whole GGUF file's size, turned into the bytes the selectable tensors may take.

The file ``voodoo export`` writes holds, beside the selectable tensors the gates choose for:

- the tensors stock llama-quantize would quantize that no candidate covers, at its base type
  (``budget.fixed_bytes``; the budget counts them already);
- every other tensor (norms, biases, ...) as the converter writes it at ``--outtype f32``: F32;
- the metadata: the converter's key/values (hyperparameters, tokenizer: measured by running
  llama.cpp's converter with ``--vocab-only``), export's own keys (imatrix source, ``voodoo.*``:
  at most :data:`EXPORT_KEYS_BYTES`), one tensor info per tensor, and the alignment padding
  (``general.alignment``, 32: at most 31 bytes after the header and after each tensor's data).

What is left of the target after these is what the selectable tensors may weigh at the budget's
upper bound (``target × (1 + tolerance)``: what the bake, the guarantee and the knapsacks never
exceed), so the written file is at most ``--target_size``, as llama.cpp's ``llama-quantize
--target-size`` counts it. tests/test_target_size.py exports one and checks.

:func:`run_budget` is the one place a run's size flags become its budget: the trainer's setup
(``training/setup.py`` ``plan_run``) and the dry run (``memory/dry_run.py``; ``memory/plan.py`` when
not given a budget) both call it.
"""

from __future__ import annotations

import logging
import tempfile
from pathlib import Path
from typing import Mapping, Sequence

import numpy as np

from ..core.errors import ConfigError
from ..core.sizes import parse_size
from ..gguf import converter
from ..gguf.layout import model_layouts
from ..selection.budget import Budget, make_budget

log = logging.getLogger(__name__)

ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (ggml/include/gguf.h); the converter writes no other
# export's own keys (tools/export.py write): general.file_type, quantize.imatrix.file and .dataset
# (each at most 127 characters), .entries_count, .chunks_count, voodoo.bpw, voodoo.file_bpw,
# voodoo.error_compensation, voodoo.size_percent, voodoo.badge: about 600 bytes; the rest is margin
EXPORT_KEYS_BYTES = 1024


def _tensor_info_bytes(name: str, n_dims: int) -> int:
    # gguf string (u64 length + bytes), u32 n_dims, u64 per dim, u32 type, u64 offset (gguf.cpp)
    return 8 + len(name.encode()) + 4 + 8 * n_dims + 4 + 8


def metadata_bytes(model_dir: str | Path) -> int:
    """The converter's header and key/values for `model_dir` (no tensor): a ``--vocab-only`` run."""
    with tempfile.TemporaryDirectory(prefix="voodoo-target-size-") as tmp:
        out = converter.convert(model_dir, Path(tmp) / "vocab.gguf", extra=("--vocab-only",))
        return out.stat().st_size


def file_tensors(model_dir: str | Path) -> dict[str, tuple[int, ...]]:
    """{GGUF name: shape (numpy order)} of every tensor the converter writes for `model_dir`."""
    unmapped: dict[str, tuple[int, ...]] = {}
    layouts = model_layouts(model_dir, min_dims=1, unmapped=unmapped)
    out = {lay.gguf_name: tuple(lay.gguf_shape) for lay in layouts.values()}
    out.update(unmapped)
    return out


def other_bytes(model_dir: str | Path, plans: Sequence, fixed: Mapping[str, tuple[int, ...]]) -> int:
    """Everything in the exported file but the selectable and the fixed tensors' data (above)."""
    tensors = file_tensors(model_dir)
    chosen = {p.gguf_name for p in plans} | set(fixed)
    missing = sorted(n for n in chosen if n not in tensors)
    for n in missing:  # a tensor the converter maps only through the plan's own layout
        tensors[n] = ()
    rest = sum(4 * int(np.prod(sh, dtype=np.int64)) for n, sh in tensors.items() if n not in chosen)
    info = sum(_tensor_info_bytes(n, max(1, len(sh))) for n, sh in tensors.items())
    padding = (ALIGNMENT - 1) * (len(tensors) + 1)
    return metadata_bytes(model_dir) + EXPORT_KEYS_BYTES + info + padding + rest


def selectable_target(file_bytes: int, other: int, fixed_bytes: int, tolerance: float) -> int:
    """The budget's target for the selectable tensors: its upper bound fits the file target."""
    room = file_bytes - other - fixed_bytes
    if room <= 0:
        raise ConfigError(f"--target_size {file_bytes:,} bytes leaves nothing for the weights: the file's "
                          f"metadata and the tensors no candidate covers take {other + fixed_bytes:,} bytes")
    return int(room / (1.0 + tolerance))


def run_budget(cfg, plans: Sequence, fixed: Mapping[str, tuple[int, ...]]) -> Budget:
    """The budget `cfg`'s (a TrainConfig) size flags ask for over `plans` and the `fixed` tensors
    (``student.build.fixed_tensors``): ``--compression_ratio``, ``--target_bits`` or, for
    ``--target_size``, the whole file less what the rest of it takes (:func:`other_bytes`)."""
    size = {}
    if cfg.target_size is not None:  # the whole file: what the rest of it takes comes off first
        size = {"file_bytes": parse_size(cfg.target_size, "--target_size"),
                "other_bytes": other_bytes(cfg.model, plans, fixed)}
    return make_budget(
        plans,
        compression_ratio=cfg.compression_ratio,
        target_bits=cfg.target_bits,
        budget_reduction=cfg.budget_reduction,
        tolerance=cfg.size_tolerance,
        fixed=fixed,
        **size,
    )
