"""The activation probe of the memory model: what autograd saves for one decoder layer.

A deep copy of the layer runs on the ``meta`` device (no memory, no compute) under
``saved_tensors_hooks``, which see every tensor autograd keeps for backward; attention is
counted as a flash kernel saves it (q, k, v, output and the log-sum-exp, never the T×T matrix).
Used by :func:`voodoo_quant.memory.plan.plan_memory`.
"""

from __future__ import annotations

import contextlib
import copy
from typing import Any

import torch
import torch.nn as nn
from ..distributed.parallel import decoder_layers


class _FakeTP:
    """A one-process stand-in for the probe: collectives change no saved-tensor sizes."""

    rank, is_main = 0, True

    def __init__(self, world: int):
        self.world = world

    def all_reduce(self, t, op="sum"):
        return t


class _FlashSDPA(torch.autograd.Function):
    """Saves what a flash-attention kernel saves (q, k, v, out, lse), not the T×T matrix."""

    @staticmethod
    def forward(ctx, q, k, v):  # type: ignore[override]
        out = q.new_empty((*q.shape[:-1], v.shape[-1]))
        lse = q.new_empty(q.shape[:-1], dtype=torch.float32)
        ctx.save_for_backward(q, k, v, out, lse)
        return out

    @staticmethod
    def backward(ctx, g):  # type: ignore[override]
        q, k, v, _, _ = ctx.saved_tensors
        return torch.zeros_like(q), torch.zeros_like(k), torch.zeros_like(v)


@contextlib.contextmanager
def _flash_attention():
    import torch.nn.functional as F

    old = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, enable_gqa=False, **kw):
        if k.shape[-3] != q.shape[-3]:  # grouped-query: the kernel reads shared k/v heads
            rep = q.shape[-3] // k.shape[-3]
            k, v = k.repeat_interleave(rep, -3), v.repeat_interleave(rep, -3)
        return _FlashSDPA.apply(q, k, v)

    F.scaled_dot_product_attention = sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = old


def layer_saved_bytes(model: nn.Module, index: int, batch: int, seq: int, dtype: torch.dtype,
                      adapter=None, world: int = 1) -> float:
    """Bytes autograd saves for decoder layer `index` of `model` (run on ``meta``) on a
    [batch, seq] input, this rank's heads under tensor parallelism; weights excluded."""
    _, layers = decoder_layers(model)
    layer = copy.deepcopy(layers[index]).to(device="meta", dtype=dtype)
    if world > 1 and adapter is not None and getattr(adapter, "supports_tp", False):
        ls = adapter.shard_layer(layers[index], world)
        for rel, sh in ls.params.items():
            mname, _, pname = rel.rpartition(".")
            mod = layer.get_submodule(mname) if mname else layer
            p = getattr(mod, pname)
            mod._parameters[pname] = nn.Parameter(sh.take(p.data, 0, world), requires_grad=False)
        for rel, attrs in ls.attrs.items():
            mod = layer.get_submodule(rel) if rel else layer
            for k, v in attrs.items():
                setattr(mod, k, v)
    for p in layer.parameters():
        p.requires_grad_(False)
    hidden = model.config.get_text_config().hidden_size
    x = torch.empty(batch, seq, hidden, device="meta", dtype=dtype, requires_grad=True)
    pos = torch.arange(seq, device="meta").unsqueeze(0).expand(batch, -1)
    base = getattr(model, model.base_model_prefix)
    rot = getattr(base, "rotary_emb", None)
    kw: dict[str, Any] = {"attention_mask": None, "position_ids": pos}
    if rot is not None:
        rot = copy.deepcopy(rot).to("meta")
        kw["position_embeddings"] = rot(x, pos)
    params = {p.untyped_storage()._cdata for p in layer.parameters()}
    seen: dict[int, int] = {}

    def pack(t: torch.Tensor):
        st = t.untyped_storage()
        if st._cdata not in params and t.requires_grad is not None:
            seen[st._cdata] = st.nbytes()
        return t

    with _flash_attention(), torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        try:
            layer(x, **kw)
        except TypeError:
            kw.pop("position_embeddings", None)
            layer(x, **kw)
    return float(sum(seen.values()))


def _layer_kinds(model: nn.Module) -> list[int]:
    """Index of the first decoder layer of each distinct layer class/kind."""
    _, layers = decoder_layers(model)
    kinds: dict[Any, int] = {}
    types = getattr(model.config.get_text_config(), "layer_types", None)
    for i, layer in enumerate(layers):
        key = (type(layer).__name__, types[i] if types and i < len(types) else None)
        kinds.setdefault(key, i)
    return list(kinds.values())
