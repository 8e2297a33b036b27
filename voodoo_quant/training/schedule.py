"""The temperature schedule and the batch order: pure functions of (config, step)."""

from __future__ import annotations

import torch


def tau_at(step: int, max_steps: int, tau_start: float, tau_end: float) -> float:
    """Geometric annealing from `tau_start` (step 0) to `tau_end` (last step).

    Geometric, because what matters for softmax(g/τ) is the ratio by which logit gaps are
    magnified; each step sharpens the mixture by the same factor.
    """
    if max_steps <= 1:
        return tau_end
    frac = step / (max_steps - 1)
    return float(tau_start * (tau_end / tau_start) ** frac)


def batch_indices(step: int, batch_size: int, n_sequences: int, seed: int) -> torch.Tensor:
    """Sequence indices of the batch at `step`: epochs of seeded permutations, no state."""
    out = []
    for pos in range(step * batch_size, (step + 1) * batch_size):
        epoch, i = divmod(pos, n_sequences)
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n_sequences, generator=g)
        out.append(int(perm[i]))
    return torch.tensor(out, dtype=torch.long)
