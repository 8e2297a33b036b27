"""Distillation losses, optionally chunked over tokens so the logits never exist whole.

    CE  = (1/N) Σ_i −log softmax(s_i)[y_i]             (next-token targets)
    KL  = (1/N) Σ_i Σ_v t_i,v (log t_i,v − log s_i,v)   (teacher ‖ student, per token)

Both are sums over tokens, so computing them chunk by chunk and adding is exact up to float
summation order. In the chunked path the student (and teacher) return their final hidden states
(``model.<base_model_prefix>(...)``) and the LM head is applied to ``--loss_chunk_size`` tokens at
a time inside a gradient checkpoint: peak memory is one ``[chunk, vocab]`` block, not
``[batch·seq, vocab]`` (a 262k vocab at 8k tokens is 8 GiB of float32 logits).

The chunked path is taken only where the head is a plain ``nn.Linear`` applied to the base
model's output, as in ``LlamaForCausalLM.forward``; a model whose config scales or soft-caps its
logits (Gemma's ``final_logit_softcapping``, Cohere's ``logit_scale``, Granite's
``logits_scaling``, ...) falls back to full logits from its own forward.
"""

from __future__ import annotations

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.lm_head import chunk_reason, is_routed_linear


def full_losses(s_logits: torch.Tensor, t_logits: torch.Tensor, ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL) means over the predicted positions, from whole logits."""
    s = s_logits[:, :-1].float().reshape(-1, s_logits.shape[-1])
    t = t_logits[:, :-1].float().reshape(-1, t_logits.shape[-1]).to(s.device)
    ce = F.cross_entropy(s, ids[:, 1:].reshape(-1).to(s.device))
    s_log = F.log_softmax(s, dim=-1)
    t_log = F.log_softmax(t, dim=-1)
    kl = (t_log.exp() * (t_log - s_log)).sum(-1).mean()
    return ce, kl


def _hidden(model: nn.Module, ids: torch.Tensor) -> torch.Tensor:
    return getattr(model, model.base_model_prefix)(input_ids=ids).last_hidden_state


def _head_of(model: nn.Module) -> nn.Module:
    # While routing is active the head attribute holds the routing wrapper, which is what to call.
    for name in ("lm_head", "output", "embed_out"):
        mod = getattr(model, name, None)
        if isinstance(mod, nn.Module):
            return mod
    return model.get_output_embeddings()


hidden_states = _hidden  # public names for the measured objective (objective.py)
head_of = _head_of


def _chunk_terms(h, w, b, th, tw, tb, tgt, head, salt_setter, salt):
    if head is None:  # .to(): under --device_map the head may sit on another device than the last layer
        s = F.linear(h.to(w.device), w, b).float()
    else:  # a routed head draws its routes per chunk: the salt keeps a recompute identical
        salt_setter(salt)
        s = head(h).float()
        salt_setter(0)  # the backward recompute must not leave its salt to the layers drawn next
    with torch.no_grad():
        t = F.linear(th.to(tw.device), tw, tb).float().to(s.device)
        t_log = F.log_softmax(t, dim=-1)
    tgt = tgt.to(s.device)
    ce = F.cross_entropy(s, tgt, reduction="sum")
    kl = (t_log.exp() * (t_log - F.log_softmax(s, dim=-1))).sum()
    return ce, kl


def distill_terms(
    student: nn.Module, teacher: nn.Module, ids: torch.Tensor, *, chunk_tokens: int = 0,
    teacher_device: torch.device | None = None, router=None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(CE, KL) of one batch. The student forward runs inside ``layers.cached()`` (the
    caller's) or, under gradient checkpointing, mixes each layer's weights as it runs
    (``trainer.micro_backward``); the LM head's mixture is taken once here either way. The
    teacher runs on `teacher_device` (default: the student's) without grad."""
    tdev = teacher_device or ids.device
    n_pred = ids.shape[0] * (ids.shape[1] - 1)
    if chunk_tokens <= 0 or n_pred <= chunk_tokens or chunk_reason(student) is not None or chunk_reason(teacher) is not None:
        with torch.no_grad():
            t_logits = teacher(input_ids=ids.to(tdev)).logits
        s_logits = student(input_ids=ids).logits
        return full_losses(s_logits, t_logits, ids)
    with torch.no_grad():
        th = _hidden(teacher, ids.to(tdev))[:, :-1].reshape(n_pred, -1)
        thead = teacher.get_output_embeddings()
        tw, tb = thead.weight, thead.bias
    h = _hidden(student, ids)[:, :-1].reshape(n_pred, -1)
    shead = _head_of(student)
    tgt = ids[:, 1:].reshape(-1)
    if is_routed_linear(shead):
        head, w, b = shead, None, None
    else:
        head, w, b = None, shead.weight, shead.bias  # the mixture once, reused by every chunk

    def set_salt(v: int) -> None:
        if router is not None:
            router.salt = v

    ce = kl = None
    for c, lo in enumerate(range(0, n_pred, chunk_tokens)):
        hi = min(n_pred, lo + chunk_tokens)
        ce_c, kl_c = checkpoint(_chunk_terms, h[lo:hi], w, b, th[lo:hi], tw, tb, tgt[lo:hi], head, set_salt, c + 1,
                                use_reentrant=False)
        ce = ce_c if ce is None else ce + ce_c
        kl = kl_c if kl is None else kl + kl_c
    set_salt(0)
    return ce / n_pred, kl / n_pred
