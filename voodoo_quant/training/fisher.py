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
empirical one. Memory: one float32 tensor per weight, on the weight's device.

From F and the very candidates training uses, ``curvature`` gives per tensor the matrix
``M[j][k] = ½ Σ F ⊙ e_j ⊙ e_k`` over its rungs: ``M[k][k]`` is the predicted ΔKL of rung k (the
``--sensitivity_kind fisher`` table), and ``M[j][j] + M[k][k] − 2 M[j][k] = ½ Σ F (W_j − W_k)²``
is the curvature the final search adds to the gates' gradient to predict a move's ΔKL.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F

from .. import ggml


def fisher_diagonal(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, seed: int = 0) -> dict[str, torch.Tensor]:
    """tensor -> diag of the per-token Fisher (mean over the predicted positions of `tokens`)."""
    modules = dict(model.named_modules())
    use: dict[str, str] = {}  # module name -> tensor name
    for p in plans:
        for m in p.modules:
            use[m] = p.name
    weights = {p.name: modules[p.modules[0]].weight for p in plans}
    fisher = {n: torch.zeros(w.shape, dtype=torch.float32, device=w.device) for n, w in weights.items()}
    saved: dict[str, torch.Tensor] = {}
    handles = []
    emb = model.get_input_embeddings()
    emb_name = next((m for m, mod in modules.items() if mod is emb), None)

    def fwd(mname):
        def hook(_mod, args, _out):
            saved[mname] = args[0].detach()
        return hook

    def bwd(mname):
        def hook(_mod, _gin, gout):
            x = saved.pop(mname)
            d = gout[0].detach()
            x2 = x.reshape(-1, x.shape[-1]).float().pow(2)
            d2 = d.reshape(-1, d.shape[-1]).float().pow(2)
            fisher[use[mname]].add_(d2.t() @ x2)
        return hook

    try:
        for mname, tname in use.items():
            mod = modules[mname]
            if isinstance(mod, nn.Linear):
                handles.append(mod.register_forward_hook(fwd(mname)))
                handles.append(mod.register_full_backward_hook(bwd(mname)))
        gen = torch.Generator().manual_seed(seed)
        n_tok = 0
        for row in tokens:
            ids = row.unsqueeze(0).to(next(model.parameters()).device)
            with torch.no_grad():
                x0 = emb(ids)
            x0 = x0.detach().requires_grad_(True)
            logits = model(inputs_embeds=x0).logits[0, :-1].float()
            with torch.no_grad():
                probs = torch.softmax(logits, dim=-1).cpu()
                y = torch.multinomial(probs, 1, generator=gen).squeeze(1).to(logits.device)
            loss = F.cross_entropy(logits, y, reduction="sum")
            (g0,) = torch.autograd.grad(loss, x0)
            if emb_name in use:  # the embedding's own use: δ_i² onto the row of token i (the sampled loss's)
                fisher[use[emb_name]].index_add_(0, ids[0], g0[0].float().pow(2))
            n_tok += logits.shape[0]
            saved.clear()
    finally:
        for h in handles:
            h.remove()
    for f in fisher.values():
        f.div_(max(1, n_tok))
    return fisher


def curvature(plan, weight: torch.Tensor, fisher: torch.Tensor, blobs: Mapping[str, bytes]) -> tuple[list[str], np.ndarray]:
    """(types, M) with ``M[j][k] = ½ Σ F ⊙ (W_j − W) ⊙ (W_k − W)`` over `blobs` (type -> ggml bytes)."""
    lib = ggml.lib()
    w = weight.detach().float().cpu()
    sf = fisher.detach().float().cpu().sqrt()
    types = list(blobs)
    errs = []
    for t in types:
        deq = lib.dequantize(blobs[t], t, (plan.rows, plan.n_per_row), name=plan.name)
        wq = plan.layout.from_gguf(torch.from_numpy(deq)).reshape(w.shape)
        errs.append(((wq - w) * sf).reshape(-1))
    e = torch.stack(errs)  # float32 [K, n]; the products are summed in float64, a chunk at a time
    m = torch.zeros(len(types), len(types), dtype=torch.float64)
    for lo in range(0, e.shape[1], 1 << 20):
        c = e[:, lo: lo + (1 << 20)].double()
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
