"""The distillation loss of a tensor-parallel rank: cross-entropy and KL(teacher ‖ student) from
vocabulary-sharded LM heads (:mod:`voodoo_quant.distributed.parallel` splits them), with a distributed
log-sum-exp, chunked over tokens and checkpointed per chunk like the single-device path
(``losses.distill_terms``), which it equals up to float summation order."""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..distributed.parallel import TPContext, tp_copy, tp_reduce
from .losses import _hidden


def _lse(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    """log Σ_v exp(x_v) over the vocabulary shards of every rank (differentiable in `x`)."""
    with torch.no_grad():
        m = tp.all_reduce(x.detach().amax(-1).contiguous(), "max")
    return tp_reduce((x - m.unsqueeze(-1)).exp().sum(-1), tp).log() + m


def _tp_chunk(h, w, b, th, tw, tb, tgt, lo: int, tp: TPContext):
    s = F.linear(tp_copy(h, tp), w, b).float()  # [T, V_r]: this rank's vocabulary
    with torch.no_grad():
        t = F.linear(th, tw, tb).float().to(s.device)
        t_log = t - _lse(t, tp).unsqueeze(-1)
        p_t = t_log.exp()
    s_lse = _lse(s, tp)
    tgt = tgt.to(s.device)
    mine = (tgt >= lo) & (tgt < lo + s.shape[-1])
    s_y = tp_reduce(s.gather(1, (tgt - lo).masked_fill(~mine, 0).unsqueeze(1)).squeeze(1) * mine, tp)
    ce = (s_lse - s_y).sum()
    # Σ_v p_t (log p_t − s_v + lse_s) = [Σ_v p_t (log p_t − s_v)] + lse_s, as Σ_v p_t = 1
    kl = (tp_reduce((p_t * (t_log - s)).sum(-1), tp) + s_lse).sum()
    return ce, kl


def tp_distill_terms(student: nn.Module, teacher: nn.Module, ids: torch.Tensor, tp: TPContext, *,
                     chunk_tokens: int = 0, teacher_device: torch.device | None = None,
                     teacher_hidden: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL) of one batch from vocabulary-sharded heads; equal to the single-device
    :func:`voodoo_quant.training.losses.distill_terms` up to float summation order.
    `teacher_hidden`: the teacher's final hidden states of this batch, [tokens − batch, hidden],
    as :func:`teacher_hidden_states` gives them (kept by the caller: the teacher does not run)."""
    tdev = teacher_device or ids.device
    n_pred = ids.shape[0] * (ids.shape[1] - 1)
    with torch.no_grad():
        th = teacher_hidden if teacher_hidden is not None else teacher_hidden_states(teacher, ids.to(tdev))
        thead = teacher.get_output_embeddings()
        tw, tb = thead.weight, thead.bias
    h = _hidden(student, ids)[:, :-1].reshape(n_pred, -1)
    shead = student.get_output_embeddings()
    lo = shead._tp_vocab[0]
    w, b = shead.weight, shead.bias
    tgt = ids[:, 1:].reshape(-1)
    step = chunk_tokens if chunk_tokens > 0 else n_pred
    ce = kl = None
    for c0 in range(0, n_pred, step):
        c1 = min(n_pred, c0 + step)
        ce_c, kl_c = checkpoint(_tp_chunk, h[c0:c1], w, b, th[c0:c1], tw, tb, tgt[c0:c1], lo, tp, use_reentrant=False)
        ce = ce_c if ce is None else ce + ce_c
        kl = kl_c if kl is None else kl + kl_c
    return ce / n_pred, kl / n_pred


def teacher_hidden_states(teacher: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    """The teacher's final hidden states at every predicting position of `ids`, [n_pred, hidden]
    (replicated on every rank: the input of its vocabulary-sharded head)."""
    with torch.no_grad():
        return _hidden(teacher, ids)[:, :-1].reshape(ids.shape[0] * (ids.shape[1] - 1), -1)
