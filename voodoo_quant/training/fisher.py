"""Downstream-aware sensitivity: how each tensor's quantization error reaches the loss.

The output-error table (``sensitivity.py``) prices a candidate by how much it perturbs its own
tensor's outputs, relative to their size: every tensor counts the same, whether its error is
amplified or washed out by the layers after it. This module prices it in the loss's own units.
Around the teacher (where KL(teacher ‖ student) and its gradient vanish) the KL of a perturbed
student is, to second order,

    ΔKL ≈ ½ Σ_t e_tᵀ F_t e_t,   e_t = W_t,q − W_t,

with F the Fisher information of the model's predictive distribution: the Hessian of the mean
per-token KL. Its diagonal is estimated exactly per token, without a backward per token: for a
Linear, the gradient of token i's log-likelihood w.r.t. W is ``δ_i x_iᵀ`` (output gradient times
input), so ``diag F = (1/N) Σ_i δ_i² (x_i²)ᵀ`` is one matmul of squared output gradients and squared
inputs; for an Embedding it is ``δ_i²`` added to the row of token i. Labels are *sampled* from
the model's own distribution (a seeded draw), which makes this the true Fisher rather than the
empirical one. Memory of the whole-model pass here (:func:`fisher_diagonal`): one float32
tensor per weight, on the weight's device. A run takes ``layerwise.py``'s road instead, one decoder
layer's accumulators at a time, the same products in the same order; this pass is left for a
loaded model that road refuses.

From F and the very candidates training uses, ``curvature`` gives per tensor the matrix
``M[j][k] = ½ Σ F ⊙ e_j ⊙ e_k`` over its rungs: ``M[k][k]`` is the predicted ΔKL of rung k (the
``--sensitivity_kind fisher`` table), and ``M[j][j] + M[k][k] − 2 M[j][k] = ½ Σ F (W_j − W_k)²``
is the curvature the final search adds to the gates' gradient to predict a move's ΔKL.
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F


class FisherHooks:
    """The Fisher diagonal's accumulation, shared by the whole-model pass (below) and the
    layer-at-a-time one (``layerwise.py``), so both add the same products in the same order.

    `use` maps module name -> tensor name (a tied embedding / LM head: two modules, one tensor);
    :meth:`linears` hooks the Linear ones among `names` (forward: keep the input; backward:
    ``F += δ²ᵀ x²``), :meth:`embedding` adds a lookup's ``δ²`` onto the rows it read."""

    def __init__(self, modules: Mapping[str, nn.Module], use: Mapping[str, str], fisher: dict[str, torch.Tensor]):
        self.modules, self.use, self.fisher = modules, use, fisher
        self._saved: dict[str, torch.Tensor] = {}

    @contextlib.contextmanager
    def linears(self, names) -> Iterator[None]:
        handles = []
        try:
            for mname in names:
                mod = self.modules[mname]
                if mname in self.use and isinstance(mod, nn.Linear):
                    handles.append(mod.register_forward_hook(self._fwd(mname)))
                    handles.append(mod.register_full_backward_hook(self._bwd(mname)))
            yield
        finally:
            for h in handles:
                h.remove()
            self._saved.clear()

    def embedding(self, mname: str, ids: torch.Tensor, grad: torch.Tensor) -> None:
        """The lookup of `ids` (one sequence) by embedding module `mname`, whose output got `grad`."""
        self.fisher[self.use[mname]].index_add_(0, ids.to(grad.device), grad.float().pow(2))

    def _fwd(self, mname):
        def hook(_mod, args, _out):
            self._saved[mname] = args[0].detach()
        return hook

    def _bwd(self, mname):
        def hook(_mod, _gin, gout):
            x = self._saved.pop(mname)
            d = gout[0].detach()
            x2 = x.reshape(-1, x.shape[-1]).float().pow(2)
            d2 = d.reshape(-1, d.shape[-1]).float().pow(2)
            self.fisher[self.use[mname]].add_(d2.t() @ x2)
        return hook


def module_uses(plans: Sequence) -> dict[str, str]:
    """module name -> the name of the planned tensor it uses."""
    return {m: p.name for p in plans for m in p.modules}


def sample_labels(logits: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """One label per position drawn from the model's own distribution (the true Fisher's)."""
    with torch.no_grad():
        probs = torch.softmax(logits, dim=-1).cpu()
        return torch.multinomial(probs, 1, generator=gen).squeeze(1).to(logits.device)


def fisher_diagonal(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """tensor -> diag of the per-token Fisher (mean over the predicted positions of `tokens`).

    The embedding's own use is added after every sequence's LM-head term, the order
    ``layerwise.py`` can keep too."""
    modules = dict(model.named_modules())
    use = module_uses(plans)
    weights = {p.name: modules[p.modules[0]].weight for p in plans}
    fisher = {n: torch.zeros(w.shape, dtype=torch.float32, device=w.device) for n, w in weights.items()}
    acc = FisherHooks(modules, use, fisher)
    emb = model.get_input_embeddings()
    emb_name = next((m for m, mod in modules.items() if mod is emb), None)
    gen = torch.Generator().manual_seed(seed)
    n_tok = 0
    lookups = []
    with acc.linears(list(use)):
        for row in tokens:
            ids = row.unsqueeze(0).to(next(model.parameters()).device)
            with torch.no_grad():
                x0 = emb(ids)
            x0 = x0.detach().requires_grad_(True)
            logits = model(inputs_embeds=x0, use_cache=False).logits[0, :-1].float()
            y = sample_labels(logits, gen)
            loss = F.cross_entropy(logits, y, reduction="sum")
            (g0,) = torch.autograd.grad(loss, x0)
            lookups.append((ids[0], g0[0]))
            n_tok += logits.shape[0]
    if emb_name in use:  # the embedding's own use: δ² onto the row of each token (the sampled loss's)
        for ids, g0 in lookups:
            acc.embedding(emb_name, ids, g0)
    for f in fisher.values():
        f.div_(max(1, n_tok))
    return fisher


def curvature(plan, weight: torch.Tensor, fisher: torch.Tensor, blobs: Mapping[str, bytes]) -> tuple[list[str], np.ndarray]:
    """(types, M) with ``M[j][k] = ½ Σ F ⊙ (W_j − W) ⊙ (W_k − W)`` over `blobs` (type -> ggml bytes)."""
    w = weight.detach().float().cpu()
    sf = fisher.detach().float().cpu().sqrt().reshape(-1)
    types = list(blobs)
    wqs = []  # every rung dequantized (float32, the weight's layout); the errors are formed a chunk at a time
    for t in types:
        wqs.append(plan.dequantize(blobs[t], t).reshape(w.shape).reshape(-1))
    w = w.reshape(-1)
    m = torch.zeros(len(types), len(types), dtype=torch.float64)
    for lo in range(0, w.numel(), 1 << 20):  # float32 errors, their products summed in float64
        hi = lo + (1 << 20)
        c = torch.stack([(q[lo:hi] - w[lo:hi]) * sf[lo:hi] for q in wqs]).double()
        m += c @ c.t()
    return types, (0.5 * m).numpy()


def curvature_table(plans: Sequence, weights: Mapping[str, torch.Tensor], fisher: Mapping[str, torch.Tensor],
                    blobs_for) -> dict[str, dict]:
    """tensor -> {"types": [...], "m": K×K list}; `blobs_for(plan)` gives type -> bytes."""
    out = {}
    for p in plans:
        types, m = curvature(p, weights[p.name], fisher[p.name], blobs_for(p))
        out[p.name] = {"types": types, "m": m.tolist()}
    return out
