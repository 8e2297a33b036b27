"""Size accounting and the dead-zone size penalty.

What counts: the bytes of the *selectable* tensors as they lie in the GGUF (exact
``ggml_row_size`` × rows of the assigned type), plus the *fixed* ones: tensors stock
llama-quantize would quantize that no candidate can stand for (a MoE's merged expert stacks, a
weight that is not a Linear/Embedding), which export writes as the tool's base type
(``BASE_TYPE``) would. Everything else in the file (norms, biases, conv kernels, metadata,
tokenizer) is the same for every assignment and is reported separately by export.
``--compression_ratio r`` targets ``r`` × (selectable + fixed tensors at uniform Q8_0, each
through llama.cpp's fallback where Q8_0 cannot take its rows); ``--target_bits b`` targets ``b``
bits per weight of those tensors; ``--target_size`` targets the whole file (``training/target_size.py``
turns it into these tensors' bytes). The fixed bytes are taken off the target first: the gates share
what is left. Without fixed tensors (every shipped dense architecture) both are the selectable
tensors' alone.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping, Sequence

import numpy as np
import torch

from ..core import qtypes as qt
from ..core.errors import ConfigError

# What stock llama-quantize writes for a quantizable tensor no --tensor-type pattern names when
# given this base type (src/llama-quant.cpp llama_tensor_get_type: at ftype Q8_0 no rule moves a
# dense model's tensor off Q8_0; an 8-expert model's attn_v/attn_k go to Q8_0 too), F16 where a
# row is not a multiple of 32 (tensor_type_fallback). tests/test_export.py checks it against the tool.
BASE_TYPE = "Q8_0"


def base_type_for(shape: tuple[int, ...]) -> str:
    return qt.resolve_for_row(BASE_TYPE, int(shape[-1])).name


@dataclass(frozen=True)
class Budget:
    q8_bytes: int  # selectable tensors at uniform Q8_0
    min_bytes: int  # every tensor on its cheapest rung
    max_bytes: int  # every tensor on its richest rung
    n_weights: int
    target_bytes: int  # what the bake must land on (within tolerance)
    train_target_bytes: int  # what training aims at (lowered by --budget_reduction)
    tolerance: float
    fixed_bytes: int = 0  # quantizable tensors no candidate covers, at BASE_TYPE (in no target below)
    n_fixed_weights: int = 0
    fixed: tuple[tuple[str, str, int], ...] = ()  # (GGUF name, type, bytes) of each of them

    @property
    def upper_bytes(self) -> int:
        """The most the baked assignment may weigh."""
        return int(self.target_bytes * (1.0 + self.tolerance))

    def bpw(self, nbytes: float) -> float:
        return 8.0 * nbytes / max(1, self.n_weights)


def make_budget(
    plans: Sequence,  # objects with .shape, .n_per_row, .rows, .sizes (bytes per menu rung)
    *,
    compression_ratio: float | None,
    target_bits: float | None,
    budget_reduction: float = 0.0,
    tolerance: float = 0.02,
    fixed: Mapping[str, tuple[int, ...]] | None = None,  # GGUF name -> shape of the fixed tensors
    file_bytes: int | None = None,  # --target_size: the whole file (training/target_size.py)
    other_bytes: int = 0,  # what the file holds beside the selectable and fixed tensors
) -> Budget:
    if sum(x is not None for x in (compression_ratio, target_bits, file_bytes)) != 1:
        raise ConfigError("give exactly one of --compression_ratio, --target_bits and --target_size")
    if not 0.0 <= budget_reduction < 1.0:
        raise ConfigError(f"--budget_reduction must be in [0, 1), got {budget_reduction}")
    if not 0.0 <= tolerance < 1.0:
        raise ConfigError(f"--size_tolerance must be in [0, 1), got {tolerance}")
    q8 = sum(qt.resolve_for_row("Q8_0", p.n_per_row).row_bytes(p.n_per_row) * p.rows for p in plans)
    lo = sum(min(p.sizes) for p in plans)
    hi = sum(max(p.sizes) for p in plans)
    n = sum(p.rows * p.n_per_row for p in plans)
    fixed = fixed or {}
    f_bytes = sum(qt.tensor_bytes(base_type_for(sh), sh) for sh in fixed.values())
    f_q8 = sum(qt.tensor_bytes(qt.resolve_for_row("Q8_0", int(sh[-1])), sh) for sh in fixed.values())
    f_n = sum(int(np.prod(sh, dtype=np.int64)) for sh in fixed.values())
    if compression_ratio is not None:
        if not 0.0 < compression_ratio <= 4.0:
            raise ConfigError(f"--compression_ratio must be in (0, 4], got {compression_ratio}")
        total = int(round(compression_ratio * (q8 + f_q8)))
        what = f"--compression_ratio {compression_ratio}"
    elif file_bytes is not None:
        # the selectable tensors' upper bound, target × (1 + tolerance), fits what the file leaves them
        total = f_bytes + int((file_bytes - other_bytes - f_bytes) / (1.0 + tolerance))
        what = f"--target_size {file_bytes:,} bytes ({other_bytes:,} of them metadata and tensors never quantized)"
    else:
        if not 0.0 < target_bits <= 32.0:
            raise ConfigError(f"--target_bits must be in (0, 32], got {target_bits}")
        total = int(round(target_bits * (n + f_n) / 8.0))
        what = f"--target_bits {target_bits}"
    target = total - f_bytes  # what the selectable tensors may weigh
    if target < lo or target > hi:
        nn, q = n + f_n, q8 + f_q8
        fix = (f" (of which {len(fixed)} tensor(s) no candidate covers, fixed at {BASE_TYPE}: {f_bytes:,} bytes)"
               if fixed else "")
        raise ConfigError(
            f"{what} asks for {total:,} bytes ({8 * total / nn:.3f} bpw) but the menus can only reach "
            f"{lo + f_bytes:,}–{hi + f_bytes:,} bytes{fix} ({8 * (lo + f_bytes) / nn:.3f}–{8 * (hi + f_bytes) / nn:.3f} bpw, "
            f"{(lo + f_bytes) / q:.3f}–{(hi + f_bytes) / q:.3f} of Q8_0)"
            + (_cheaper_types_hint(plans, lo, q, f_bytes) if target < lo else "")
        )
    train_target = max(lo, int(round(target * (1.0 - budget_reduction))))
    per = tuple((k, base_type_for(sh), qt.tensor_bytes(base_type_for(sh), sh)) for k, sh in sorted(fixed.items()))
    return Budget(q8, lo, hi, n, target, train_target, tolerance, f_bytes, f_n, per)


def cheapest_for_row(n_per_row: int) -> qt.QType:
    """The fewest bytes per row any quantized type llama.cpp serves for rows of `n_per_row`."""
    served = {qt.resolve_for_row(t, n_per_row) for t in qt.MENU_TYPES if not qt.get(t).is_float}
    return min(served, key=lambda q: (q.row_bytes(n_per_row), q.name))


def _cheaper_types_hint(plans: Sequence, lo: int, q8: int, f_bytes: int) -> str:
    """Where types off the menus would reach lower: the floor over every type, and which types."""
    floor, cheapest = 0, {}
    for p in plans:
        c = cheapest_for_row(p.n_per_row)
        floor += min(c.row_bytes(p.n_per_row) * p.rows, min(p.sizes))
        cheapest[p.n_per_row] = c
    if floor >= lo:
        return "; no llama.cpp type is cheaper for these tensors"
    names = ", ".join(f"{n}-wide rows {c.name} ({c.bpw:g} bpw{', needs an imatrix' if c.needs_imatrix else ''})"
                      for n, c in sorted(cheapest.items()))
    return (f"; with every llama.cpp type the floor is {(floor + f_bytes) / q8:.3f} of Q8_0 "
            f"(cheapest: {names})")


def size_penalty(expected: torch.Tensor, target: float, tolerance: float, weight: float) -> torch.Tensor:
    """Dead zone: 0 while |expected/target − 1| ≤ tolerance, then weight · excess² outside."""
    rel = expected / float(target) - 1.0
    excess = torch.clamp(rel.abs() - tolerance, min=0.0)
    return weight * excess * excess
