"""Forwards that serve ONE candidate instead of the soft mixture, with the mixture's gate gradient.

Two modes, both active only inside :func:`routed` (the trainer wraps the student forward in it):

- ``ptqr`` (per-token quantization routing): every token of every use of a selectable weight goes
  through one candidate, drawn per token from the gate probabilities by Gumbel-max. In
  expectation the forward is the deployed (baked) model, and as τ anneals the draws converge to
  the argmax. Backward is straight-through: the weight gradient is ``G = Σ_i g_i x_iᵀ`` exactly as
  if the weight were the soft mixture, so ``dL/dp_k = <G, W_k>`` (the soft mixture's formula in
  ``layers._Mix``); the input gradient is that of the routed forward.
- ``st_gumbel`` (ablation): one candidate per tensor per step, ``argmax(log p + Gumbel)/τ_g``,
  with the straight-through gradient of ``softmax((log p + Gumbel) / τ_g)``.

Draws are a pure function of (seed, step, tensor, use, chunk salt): a resumed run and a
gradient-checkpoint recompute see the same candidates. Only plain ``nn.Linear`` and
``nn.Embedding`` are routed; a subclass with its own forward (scaled embeddings, ...) keeps the
soft mixture, logged once.
"""

from __future__ import annotations

import contextlib
import logging
import zlib
from dataclasses import dataclass
from typing import Iterator, Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from ..student.layers import MixedQuant, _Mix

log = logging.getLogger(__name__)

MODES = ("ptqr", "st_gumbel")


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def gumbel(n: int, seed: int, device: torch.device) -> torch.Tensor:
    """n standard Gumbel draws from a generator seeded by `seed` alone (float32)."""
    g = torch.Generator(device=device).manual_seed(seed)
    u = torch.rand(n, generator=g, device=device, dtype=torch.float32)
    u = u.clamp(min=torch.finfo(torch.float32).tiny, max=1.0 - torch.finfo(torch.float32).eps)
    return -torch.log(-torch.log(u))


def sample_routes(p: torch.Tensor, n_tokens: int, seed: int) -> torch.Tensor:
    """[n_tokens] candidate indices: Gumbel-max over log p, one draw per token (exact sampling)."""
    logp = torch.log(p.detach().float())  # log 0 = -inf: a zero-probability rung is never drawn
    noise = gumbel(n_tokens * p.numel(), seed, p.device).view(n_tokens, p.numel())
    return torch.argmax(logp.unsqueeze(0) + noise, dim=1)


class _RoutedLinear(torch.autograd.Function):
    """y_i = x_i W_{r_i}ᵀ + b; backward: dx exact for the routes, dp_k = <Σ_i g_i x_iᵀ, W_k>."""

    @staticmethod
    def forward(ctx, x, p, routes, mq, bias):  # type: ignore[override]
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        used = torch.unique(routes).tolist()
        if len(used) == 1:
            # One candidate for every token: the very call the baked model makes (bit-exact).
            out = F.linear(x, mq.candidate(used[0]).to(x.dtype), bias)
        else:
            out = None
            for k in used:
                idx = (routes == k).nonzero(as_tuple=True)[0]
                part = F.linear(x2[idx], mq.candidate(k).to(x.dtype), bias)
                if out is None:
                    out = x2.new_empty((x2.shape[0], part.shape[-1]))
                out[idx] = part
            out = out.reshape(*shape[:-1], out.shape[-1])
        ctx.mq = mq
        ctx.used = used
        ctx.save_for_backward(x, p, routes)
        return out

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        x, p, routes = ctx.saved_tensors
        mq: MixedQuant = ctx.mq
        x2 = x.reshape(-1, x.shape[-1])
        g2 = gy.reshape(-1, gy.shape[-1])
        gx = None
        if ctx.needs_input_grad[0]:
            gx = torch.zeros_like(x2)
            for k in ctx.used:
                idx = (routes == k).nonzero(as_tuple=True)[0]
                gx[idx] = g2[idx] @ mq.candidate(k).to(g2.dtype)
            gx = gx.reshape(x.shape)
        gp = None
        if ctx.needs_input_grad[1]:
            acc = _acc(gy.dtype)
            gw = (g2.t() @ x2).to(acc)  # the soft mixture's weight gradient (straight-through)
            gw = gw.reshape(-1)  # one dot per candidate, as layers._Mix computes the soft mixture's dL/dp_k
            gp = torch.stack([torch.dot(gw, mq.candidate(k).to(acc).reshape(-1)) for k in range(mq.k)]).to(p.dtype)
        return gx, gp, None, None, None


class _RoutedEmbedding(torch.autograd.Function):
    """e_i = W_{r_i}[id_i]; backward: dp_k = Σ_i <g_i, W_k[id_i]> (= <scatter(g), W_k>)."""

    @staticmethod
    def forward(ctx, ids, p, routes, mq, padding_idx):  # type: ignore[override]
        flat = ids.reshape(-1)
        used = torch.unique(routes).tolist()
        if len(used) == 1:
            out = F.embedding(ids, mq.candidate(used[0]).to(mq.dtype), padding_idx)
        else:
            out = None
            for k in used:
                idx = (routes == k).nonzero(as_tuple=True)[0]
                part = F.embedding(flat[idx], mq.candidate(k).to(mq.dtype), padding_idx)
                if out is None:
                    out = part.new_empty((flat.shape[0], part.shape[-1]))
                out[idx] = part
            out = out.reshape(*ids.shape, out.shape[-1])
        ctx.mq = mq
        ctx.save_for_backward(ids, p)
        return out

    @staticmethod
    def backward(ctx, gy):  # type: ignore[override]
        ids, p = ctx.saved_tensors
        mq: MixedQuant = ctx.mq
        acc = _acc(gy.dtype)
        flat = ids.reshape(-1)
        g2 = gy.reshape(-1, gy.shape[-1]).to(acc)
        gp = torch.stack([(g2 * mq.candidate(k).to(acc)[flat]).sum() for k in range(mq.k)]).to(p.dtype)
        return None, gp, None, None, None


def st_gumbel_probs(p: torch.Tensor, tau_hard: float, seed: int) -> torch.Tensor:
    """A one-hot vector (forward, exactly) carrying the gradient of softmax((log p + G) / τ_g)."""
    noise = gumbel(p.numel(), seed, p.device).to(p.dtype)
    soft = torch.softmax((torch.log(p.clamp_min(torch.finfo(p.dtype).tiny)) + noise) / tau_hard, dim=0)
    hard = torch.zeros_like(soft)
    hard[int(torch.argmax(soft.detach()))] = 1.0
    return hard + (soft - soft.detach())  # exactly one-hot in value: 1 + 0 and 0 + 0


@dataclass
class Router:
    mode: str
    seed: int
    step: int
    tau_hard: float = 0.5
    salt: int = 0  # set by the chunked loss for each chunk of the LM head

    def key(self, *parts: str) -> int:
        h = zlib.crc32("\0".join(parts).encode())
        # The salt goes into the low 32 bits: a CPU torch.Generator seeds mt19937 from those alone
        # (manual_seed(s) and manual_seed(s + (k << 32)) draw the same numbers), so a salt in the
        # high bits gave every chunk of the LM head the same routes. Salt 0 leaves the key as it was.
        salt = (self.salt * 0x9E3779B1) & 0xFFFFFFFF
        return (self.seed * 1_000_003 + self.step) * 4_294_967_311 % (1 << 62) ^ h ^ (self.salt << 32) ^ salt


class RoutedModule(nn.Module):
    """Stands in for one parametrized Linear/Embedding while :func:`routed` is active."""

    def __init__(self, inner: nn.Module, mq: MixedQuant, use: str, router: Router):
        super().__init__()
        self.inner = inner
        self.mq = mq
        self.use = use
        self.router = router

    @property
    def stands_in_for(self) -> nn.Module:
        """The module this one replaces (model/lm_head.py asks whether it is a Linear)."""
        return self.inner

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        mq, r = self.mq, self.router
        p = mq.probs()
        if r.mode == "st_gumbel":
            # One draw per tensor (all its uses: a tied embedding and head pick the same rung).
            y = st_gumbel_probs(p, r.tau_hard, r.key(mq.name))
            w = _Mix.apply(y, mq.candidate, mq.k, mq.dtype)
            if isinstance(self.inner, nn.Embedding):
                return F.embedding(x, w, self.inner.padding_idx)
            return F.linear(x, w.to(x.dtype), self.inner.bias)
        n = x.numel() if isinstance(self.inner, nn.Embedding) else x.numel() // x.shape[-1]
        routes = sample_routes(p, n, r.key(mq.name, self.use))
        if isinstance(self.inner, nn.Embedding):
            return _RoutedEmbedding.apply(x, p, routes, mq, self.inner.padding_idx)
        return _RoutedLinear.apply(x, p, routes, mq, self.inner.bias)


def _plain_class(module: nn.Module) -> type:
    # register_parametrization swaps the class for a generated subclass of the original one.
    return type(module).__mro__[1] if parametrize.is_parametrized(module) else type(module)


def routable(module: nn.Module) -> MixedQuant | None:
    if not parametrize.is_parametrized(module, "weight"):
        return None
    mq = module.parametrizations.weight[0]
    if not isinstance(mq, MixedQuant) or mq.baked is not None:
        return None
    cls = _plain_class(module)
    if cls is nn.Linear:
        return mq
    if cls is nn.Embedding and module.max_norm is None:
        return mq
    return None


@contextlib.contextmanager
def routed(model: nn.Module, router: Router | None) -> Iterator[Mapping[str, RoutedModule]]:
    """Swap every routable layer of `model` for a :class:`RoutedModule`; restore on exit."""
    if router is None:
        yield {}
        return
    if router.mode not in MODES:
        raise ValueError(f"unknown routing mode {router.mode!r}")
    swaps: list[tuple[nn.Module, str, nn.Module, RoutedModule]] = []
    for name, mod in list(model.named_modules()):
        mq = routable(mod) if name else None
        if mq is None:
            continue
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name) if parent_name else model
        swaps.append((parent, child, mod, RoutedModule(mod, mq, name, router)))
    try:
        for parent, child, _, w in swaps:
            setattr(parent, child, w)
        yield {w.use: w for *_, w in swaps}
    finally:
        for parent, child, mod, _ in swaps:
            setattr(parent, child, mod)


def unroutable(model: nn.Module) -> list[str]:
    """Parametrized layers that routing leaves on the soft mixture (their class has its own forward)."""
    return [n for n, m in model.named_modules()
            if parametrize.is_parametrized(m, "weight") and isinstance(m.parametrizations.weight[0], MixedQuant)
            and routable(m) is None]


def router_for(cfg, step: int) -> Router | None:
    """The routing of `step` under `cfg`: PTQR on every step, ST-Gumbel on the last fraction."""
    if cfg.ptqr:
        return Router("ptqr", cfg.seed, step)
    if cfg.st_gumbel_fraction > 0 and step >= round(cfg.max_steps * (1.0 - cfg.st_gumbel_fraction)):
        return Router("st_gumbel", cfg.seed, step, tau_hard=cfg.st_gumbel_tau)
    return None
