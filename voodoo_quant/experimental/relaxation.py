"""The relaxation gap: what the soft mixture hides from the gates, added back to their loss.

The gates train on the mixture ``W̄ = Σ_k p_k W_k``, but the file serves one candidate. The two
differ systematically: quantization errors of different candidates are nearly independent, so
averaging them cancels part of each, and the mixture's KL is *lower* than that of any candidate it
mixes (on SmolLM2 the warm-started mixture measures KL ≈ 0.03 at τ = 1 while the one-hot files
around it measure 0.06 – 0.08). The gradient then rewards mixing itself: a cheap rung pulled into
the mixture lowers the loss, the gates drift to fewer bytes and a worse argmax than their start.

The expected KL of the *file* a sampled one-hot choice k ~ p would write is, to second order around
the mixture (the first-order term vanishes because E[W_k] = W̄),

    E_k[KL(W_k)] ≈ KL(W̄) + ½ Σ_k p_k (W_k − W̄)ᵀ F (W_k − W̄)
                 = KL(W̄) + Σ_k p_k M_kk − pᵀ M p,        M_jk = ½ Σ F ⊙ e_j ⊙ e_k

with F the per-token Fisher diagonal and ``M`` exactly the curvature matrices of the sensitivity
pass (``fisher.curvature``; errors e_k = W_k − W). Tensors are drawn independently, so the cross
terms between tensors vanish in expectation and the gap is a sum over tensors. It is zero for a
one-hot p and largest for a spread one; with it the gates descend the expected KL of the file they
will bake, not that of a mixture no file can hold (``--relaxation_gap``).
"""

from __future__ import annotations

from typing import Mapping

import torch


class RelaxationGap:
    """Σ_t (pᵀ diag M_t − pᵀ M_t p) over the gated tensors, differentiable w.r.t. the gates."""

    def __init__(self, mixed: Mapping[str, object], curvature: Mapping[str, dict]):
        self._terms: list[tuple[object, torch.Tensor]] = []
        for name, mq in mixed.items():
            c = curvature.get(name)
            if c is None or not set(mq.menu) <= set(c["types"]):
                continue
            idx = [c["types"].index(t) for t in mq.menu]
            m = torch.tensor(c["m"], dtype=torch.float64)[idx][:, idx]
            self._terms.append((mq, m.to(mq.gates.device)))

    def __len__(self) -> int:
        return len(self._terms)

    def __call__(self, device: torch.device) -> torch.Tensor | None:
        """The gap (float64 on `device`), None when no gated tensor has curvature."""
        total = None
        for mq, m in self._terms:
            if mq.baked is not None:
                continue
            p = mq.probs().to(torch.float64)
            g = (p @ m.diagonal() - p @ (m @ p)).to(device)
            total = g if total is None else total + g
        return total
