"""Checkpointed decoder layers whose kept input is split across the tensor-parallel ranks.

Under tensor parallelism every rank holds the same hidden states between decoder layers (each
layer's row-parallel outputs are all-reduced), so the input a checkpointed layer keeps for its
backward recompute is the same tensor on every rank: 64 layers × 8192 tokens × 5120 in bf16 is
5.4 GB per rank at 27B. Here each rank keeps only its 1/world slice of that input, and gathers the
whole input back (one all-gather) just before recomputing the layer in backward, as DeepSpeed's
"partition activations" does. The layer is recomputed from the very same values, so the forward,
the input gradient and the gate gradients are those of ``torch.utils.checkpoint`` (bit for bit;
tests/test_tp_checkpoint.py). A layer called with more than one positional tensor, or whose
input needs no gradient, falls back to the ordinary non-reentrant checkpoint.
"""

from __future__ import annotations

import functools

import torch
import torch.nn as nn
from torch.utils.checkpoint import checkpoint


class _PartitionedLayer(torch.autograd.Function):
    """y = fn(x), keeping 1/world of x; backward: all-gather x, recompute fn, backpropagate."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, fn, tp) -> torch.Tensor:  # type: ignore[override]
        n = x.numel()
        per = -(-n // tp.world)
        lo, hi = min(n, tp.rank * per), min(n, (tp.rank + 1) * per)
        part = x.new_zeros(per)
        part[: hi - lo] = x.detach().reshape(-1)[lo:hi]
        ctx.part, ctx.n, ctx.shape, ctx.fn, ctx.tp = part, n, x.shape, fn, tp
        out = fn(x)  # grad mode is off inside an autograd.Function's forward
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"a partitioned checkpoint needs a layer that returns one tensor, got {type(out).__name__}")
        return out

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        x = torch.cat(ctx.tp.all_gather(ctx.part))[: ctx.n].view(ctx.shape).detach().requires_grad_(True)
        ctx.part = None
        with torch.enable_grad():
            out = ctx.fn(x)
        torch.autograd.backward(out, g)
        return x.grad, None, None


def partitioned_checkpoint(fn, *args, tp):
    """HF's ``_gradient_checkpointing_func`` for a tensor-parallel rank (see the module doc)."""
    if len(args) == 1 and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
        return _PartitionedLayer.apply(args[0], fn, tp)
    return checkpoint(fn, *args, use_reentrant=False)


def install(model: nn.Module, tp) -> int:
    """Make every checkpointed decoder layer of `model` keep only this rank's slice of its input
    (after ``gradient_checkpointing_enable``). Returns the number of layers changed."""
    from transformers.modeling_layers import GradientCheckpointingLayer

    fn = functools.partial(partitioned_checkpoint, tp=tp)
    n = 0
    for m in model.modules():
        if isinstance(m, GradientCheckpointingLayer) and getattr(m, "gradient_checkpointing", False):
            m._gradient_checkpointing_func = fn
            n += 1
    return n
