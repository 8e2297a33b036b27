"""Size accounting and the dead-zone size penalty.

What counts: the bytes of the *selectable* tensors as they lie in the GGUF (exact
``ggml_row_size`` × rows of the assigned type). Everything else in the file (norms, biases,
conv kernels, metadata, tokenizer) is the same for every assignment and is reported separately
by export. ``--compression_ratio r`` targets ``r`` × the selectable tensors' bytes at uniform
Q8_0 (each through llama.cpp's fallback where Q8_0 cannot take its rows); ``--target_bits b``
targets ``b`` bits per selectable weight.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from . import qtypes as qt
from .errors import ConfigError


@dataclass(frozen=True)
class Budget:
    q8_bytes: int  # selectable tensors at uniform Q8_0
    min_bytes: int  # every tensor on its cheapest rung
    max_bytes: int  # every tensor on its richest rung
    n_weights: int
    target_bytes: int  # what the bake must land on (within tolerance)
    train_target_bytes: int  # what training aims at (lowered by --budget_reduction)
    tolerance: float

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
) -> Budget:
    if (compression_ratio is None) == (target_bits is None):
        raise ConfigError("give exactly one of --compression_ratio and --target_bits")
    if not 0.0 <= budget_reduction < 1.0:
        raise ConfigError(f"--budget_reduction must be in [0, 1), got {budget_reduction}")
    if not 0.0 <= tolerance < 1.0:
        raise ConfigError(f"--size_tolerance must be in [0, 1), got {tolerance}")
    q8 = sum(qt.resolve_for_row("Q8_0", p.n_per_row).row_bytes(p.n_per_row) * p.rows for p in plans)
    lo = sum(min(p.sizes) for p in plans)
    hi = sum(max(p.sizes) for p in plans)
    n = sum(p.rows * p.n_per_row for p in plans)
    if compression_ratio is not None:
        if not 0.0 < compression_ratio <= 4.0:
            raise ConfigError(f"--compression_ratio must be in (0, 4], got {compression_ratio}")
        target = int(round(compression_ratio * q8))
        what = f"--compression_ratio {compression_ratio}"
    else:
        if not 0.0 < target_bits <= 32.0:
            raise ConfigError(f"--target_bits must be in (0, 32], got {target_bits}")
        target = int(round(target_bits * n / 8.0))
        what = f"--target_bits {target_bits}"
    if target < lo or target > hi:
        raise ConfigError(
            f"{what} asks for {target:,} bytes ({8 * target / n:.3f} bpw) but the menus can only reach "
            f"{lo:,}–{hi:,} bytes ({8 * lo / n:.3f}–{8 * hi / n:.3f} bpw, "
            f"{lo / q8:.3f}–{hi / q8:.3f} of Q8_0)"
        )
    train_target = max(lo, int(round(target * (1.0 - budget_reduction))))
    return Budget(q8, lo, hi, n, target, train_target, tolerance)


def size_penalty(expected: torch.Tensor, target: float, tolerance: float, weight: float) -> torch.Tensor:
    """Dead zone: 0 while |expected/target − 1| ≤ tolerance, then weight · excess² outside."""
    rel = expected / float(target) - 1.0
    excess = torch.clamp(rel.abs() - tolerance, min=0.0)
    return weight * excess * excess
