"""``MixedQuant``: K frozen candidates of one weight tensor and one learnable gate per candidate.

During training a selectable weight is the softmax mixture ``W = Σ_k p_k · W_k`` with
``p = softmax(g / τ)``. The module is registered as a torch *parametrization* of the layer's
``weight`` (``torch.nn.utils.parametrize``), so the layer's own forward is untouched: any Linear,
Embedding or subclass (scaled embeddings, ...) works, and a tied embedding / LM head is one
``MixedQuant`` registered on both. Inside :func:`cached` (``parametrize.cached()``, plus one
mixture per ``MixedQuant`` however many modules it is registered on: a tied embedding and LM head
are mixed once, not once each) the mixture is computed once per forward call, not per token and
not per use, and the trainer has it written into a tensor kept across steps (:class:`MixBuffers`);
under ``--gradient_checkpointing`` the trainer
mixes each layer's weights when the layer runs instead (``trainer.mixes_per_layer``), and a
weight over ``MIX_CHUNK_ELEMENTS`` is mixed a block of rows at a time.

Candidates are either held dequantized (eager: a float32 stack, or on the CPU their int8 codes
and sub-block scales, :class:`~voodoo_quant.candidates.compact.CompactCandidates`, mixed by a native kernel)
or packed as their ggml bytes (``--lazy``) and dequantized on the fly by
:mod:`voodoo_quant.quants`. Either way the mixture runs through
:class:`_Mix`, which keeps only one candidate materialized at a time and recomputes candidates
in backward instead of saving them: memory is the packed bytes plus one dense weight.
"""

from __future__ import annotations

import contextlib
from typing import Callable, Iterator, Sequence

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ..candidates.compact import CompactCandidates

CandidateFn = Callable[[int], torch.Tensor]


# Inside cached(): each MixedQuant's weight by id, so a gate set registered on several modules
# (a tied embedding and LM head) is mixed once, and its backward takes one pass over the
# candidates with the modules' gradients already summed by autograd.
_shared: dict[int, torch.Tensor] | None = None
# Inside cached(buffers): where the eager float32 mixtures are written (see MixBuffers).
_buffers: "MixBuffers | None" = None


class MixBuffers:
    """The soft mixtures' output tensors, kept from one training step to the next.

    A step allocates one dense tensor per gated weight (SmolLM2-135M: 211 of them, 0.64 GB) and
    frees them all after backward. On the CPU that churn returns memory to the kernel and faults it
    back in on the next step, and it slows what runs beside the mixtures too (the loss's logits
    land in freshly faulted pages). Writing each mixture into the same tensor every step removes
    the churn; the values are bit-identical (the same product, written with ``out=``).

    Safe only where every mixture of a step is dead before the next one is computed: the trainer's
    step mixes each gate set once per micro-batch (``cached()``) and finishes its backward before
    the next micro-batch. A write into a buffer that autograd still holds is not silent: the write
    bumps the buffer's version counter, and autograd refuses the stale mixture (a view made inside
    a custom Function whose base changed) in the pending backward. Per-layer mixing (gradient
    checkpointing), routed steps and the post-training search take fresh tensors. ``clear()``
    when training ends: the buffers hold one dense copy of every gated weight.
    """

    def __init__(self) -> None:
        self._out: dict[int, torch.Tensor] = {}

    def take(self, owner: object, shape: Sequence[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """`owner`'s buffer (allocated on first use, or again when its shape, dtype or device moved)."""
        t = self._out.get(id(owner))
        if t is None or tuple(t.shape) != tuple(shape) or t.dtype != dtype or t.device != device:
            t = self._out[id(owner)] = torch.empty(tuple(shape), dtype=dtype, device=device)
        return t

    @property
    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self._out.values())

    def clear(self) -> None:
        self._out.clear()


@contextlib.contextmanager
def cached(buffers: MixBuffers | None = None) -> Iterator[None]:
    """``parametrize.cached()`` for gated models: every parametrized weight computed once, and
    every ``MixedQuant`` once however many modules share it; with `buffers`, eager float32
    mixtures are written into tensors kept across steps (:class:`MixBuffers`)."""
    global _shared, _buffers
    outer, outer_buffers = _shared, _buffers
    if outer is None:
        _shared = {}
    if buffers is not None:
        _buffers = buffers
    try:
        with parametrize.cached():
            yield
    finally:
        if outer is None:
            _shared = None
        _buffers = outer_buffers


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


# A weight with more elements than this is mixed, and its gate gradient taken, a block of rows at
# a time (when its candidates can be read by rows): the float32 accumulator, the product and the
# dequantized candidate then cost a block, not the tensor (a 27B model's 62080 x 5120 vocabulary
# shard per rank would otherwise take 3.8 GB of transients). 2^25 elements: 134 MB of float32.
MIX_CHUNK_ELEMENTS = 1 << 25


def row_reader(get) -> Callable[[int, int, int], torch.Tensor] | None:
    """(k, lo, hi) -> rows lo:hi (first dimension) of candidate k, or None when the candidates
    cannot be read by rows (a layout that permutes across rows: then the tensor is mixed whole)."""
    if isinstance(get, torch.Tensor):
        return lambda k, lo, hi: get[k, lo:hi]
    return getattr(get, "row_reader", None)


def chunk_rows(shape: Sequence[int], limit: int | None = None) -> int:
    """Rows per block for a weight of `shape` (all of them when it is small enough)."""
    limit = MIX_CHUNK_ELEMENTS if limit is None else limit
    rows = int(shape[0]) if len(shape) else 1
    per_row = 1
    for s in shape[1:]:
        per_row *= int(s)
    if rows * per_row <= limit:
        return rows
    return max(1, limit // max(1, per_row))


def _mix_block(p: torch.Tensor, cand, stacked: torch.Tensor | None, k_count: int, acc: torch.dtype,
               out: torch.Tensor | None = None) -> torch.Tensor:
    """Σ_k p_k W_k in `acc`: one matrix-vector product over a float32 stack (into `out` when
    given: the same product, the same bits), else in order into one buffer (each product rounded
    to `acc`, then added)."""
    if stacked is not None and stacked.dtype == acc:
        if out is not None:  # what `p @ W` runs (matmul of a vector by a matrix is this mm)
            torch.mm(p.to(acc).unsqueeze(0), stacked.reshape(k_count, -1), out=out.view(1, -1))
            return out.view(stacked.shape[1:])
        return (p.to(acc) @ stacked.reshape(k_count, -1)).reshape(stacked.shape[1:])
    out = buf = None
    for k in range(k_count):
        w = cand(k)
        if out is None:
            out = torch.empty(w.shape, dtype=acc, device=w.device)
            buf = torch.empty_like(out)
            out.copy_(w).mul_(p[k].to(acc))
        else:
            buf.copy_(w).mul_(p[k].to(acc))
            out.add_(buf)
    return out


class _Mix(torch.autograd.Function):
    """W = Σ_k p_k W_k with dL/dp_k = <dL/dW, W_k>; `get` is the stacked (K, *shape) candidates
    (eager) or a callable k -> W_k producing them on demand (lazy).

    Eager float32 candidates: the sum is one matrix-vector product over the stack, p @ W.view(K, -1)
    (one pass over the candidates, no temporaries). It agrees with the sequential sum below to
    float32 rounding, bit for bit where the BLAS neither fuses the multiply-add nor reorders
    (tests/test_layers.py checks lazy == eager exactly on a tiny model; on an AMD EPYC host a
    large stack's product differs from the loop's in the last bit). Otherwise the
    candidates are summed in order into one buffer, each product rounded to the accumulation
    dtype and then added, exactly as before, without allocating a temporary per candidate.
    Backward takes one dot product per candidate (no [shape] temporary either way), the same
    call for eager and lazy candidates, in float64 when `p` is (the search's probe).

    A weight larger than ``MIX_CHUNK_ELEMENTS`` whose candidates can be read by rows is mixed a
    block of rows at a time into the output (each element computed by the very same operations,
    so the mixture is bit-identical), and backward sums the dot products block by block (the
    same sums in another order: equal to float32 rounding; tests/test_mix_chunks.py).
    """

    @staticmethod
    def forward(ctx, p: torch.Tensor, get, k_count: int, dtype: torch.dtype, limit: int | None = None,  # type: ignore[override]
                buf: torch.Tensor | None = None):
        acc = _acc_dtype(dtype)  # accumulate in at least float32; `buf`: MixedQuant._weight's, only where
        # the product lands in it as is (a float32 weight from a float32 stack or from int8 codes)
        ctx.compact = isinstance(get, CompactCandidates) and dtype == torch.float32 == p.dtype
        if ctx.compact:  # the native kernel: the sequential sum, expanded from the codes in cache
            ctx.get, ctx.acc, ctx.k_count, ctx.step = get, acc, k_count, None
            ctx.save_for_backward(p)
            return get.mix(p, buf)
        stacked = get if isinstance(get, torch.Tensor) else None
        cand = (lambda k: stacked[k]) if stacked is not None else get
        rows = row_reader(get)
        shape = tuple(stacked.shape[1:]) if stacked is not None else getattr(get, "shape", None)
        step = chunk_rows(shape, limit) if rows is not None and shape is not None else None
        if step is None or step >= shape[0]:
            out = _mix_block(p, cand, stacked, k_count, acc, buf).to(dtype)
            step = None
        else:
            out = None
            for lo in range(0, shape[0], step):
                hi = min(shape[0], lo + step)
                sub = stacked[:, lo:hi] if stacked is not None else None
                block = _mix_block(p, lambda k: rows(k, lo, hi), sub, k_count, acc)
                if out is None:
                    out = buf.view(shape) if buf is not None else torch.empty(shape, dtype=dtype, device=block.device)
                out[lo:hi].copy_(block)
                del block
        ctx.acc = acc
        ctx.get = get
        ctx.k_count = k_count
        ctx.step = step
        ctx.save_for_backward(p)
        return out

    @staticmethod
    def backward(ctx, grad_w: torch.Tensor):  # type: ignore[override]
        (p,) = ctx.saved_tensors
        get = ctx.get
        acc = torch.float64 if p.dtype == torch.float64 else ctx.acc  # float64 gates: float64 dot products
        if ctx.compact:
            grads = get.grad(grad_w)
        elif ctx.step is None:
            g = grad_w.to(acc).reshape(-1)
            cand = (lambda k: get[k]) if isinstance(get, torch.Tensor) else get
            grads = torch.stack([torch.dot(g, cand(k).to(acc).reshape(-1)) for k in range(ctx.k_count)])
        else:
            rows = row_reader(get)
            grads = None
            for lo in range(0, grad_w.shape[0], ctx.step):
                hi = min(grad_w.shape[0], lo + ctx.step)
                g = grad_w[lo:hi].to(acc).reshape(-1)
                part = torch.stack([torch.dot(g, rows(k, lo, hi).to(acc).reshape(-1)) for k in range(ctx.k_count)])
                grads = part if grads is None else grads.add_(part)
        return grads.to(p.dtype), None, None, None, None, None


def _device_of(candidates) -> torch.device:
    dev = getattr(candidates, "device", None)
    return torch.device(dev) if dev is not None else torch.device("cpu")


class MixedQuant(nn.Module):
    """Gates over K candidates of one tensor; a parametrization of a layer's ``weight``.

    Args:
        name: the HF parameter name (for reports).
        menu: type names, cheapest first.
        nbytes: exact GGUF bytes of each candidate.
        candidates: a (K, *shape) tensor (eager), or a callable k -> tensor (lazy).
        shape: the weight's shape.
        dtype: the dtype of the produced weight (training dtype).
        device: where the gates and byte sizes live; default: the candidates' device (a tensor's,
            or a lazy source's ``.device``), else the CPU. It must be where the weight is used:
            autograd refuses a gate gradient on another device than the gate.
    """

    def __init__(
        self,
        name: str,
        menu: Sequence[str],
        nbytes: Sequence[int],
        candidates: torch.Tensor | CandidateFn,
        shape: Sequence[int],
        dtype: torch.dtype = torch.float32,
        init_logits: torch.Tensor | None = None,
        device: torch.device | str | None = None,
    ):
        super().__init__()
        if len(menu) != len(nbytes) or not menu:
            raise ValueError(f"{name}: menu and nbytes must be non-empty and of equal length")
        self.name = name
        self.menu = tuple(menu)
        self.shape = tuple(int(s) for s in shape)
        self.dtype = dtype
        device = torch.device(device) if device is not None else _device_of(candidates)
        self.register_buffer("nbytes", torch.tensor([float(b) for b in nbytes], dtype=torch.float64, device=device),
                             persistent=False)
        if callable(candidates):
            self._get: CandidateFn = candidates
            self.stacked = None
        else:
            if tuple(candidates.shape) != (len(menu), *self.shape):
                raise ValueError(f"{name}: candidates of shape {tuple(candidates.shape)}, expected {(len(menu), *self.shape)}")
            self.register_buffer("stacked", candidates, persistent=False)
            self._get = lambda k: self.stacked[k]
        init = torch.zeros(len(menu)) if init_logits is None else init_logits.detach().float().clone()
        self.gates = nn.Parameter(init.to(device))
        self.tau = 1.0
        self.baked: int | None = None
        # (p, get, k): serve a mixture of external rungs (or, with p None, get(0) exactly) instead
        # of the gates' own: the final search's probes and served assignments (training/rungs.py).
        self.override: tuple | None = None

    # -- inspection ---------------------------------------------------------------------------
    @property
    def k(self) -> int:
        return len(self.menu)

    def probs(self) -> torch.Tensor:
        return torch.softmax(self.gates.to(_acc_dtype(self.gates.dtype)) / self.tau, dim=0)

    def argmax(self) -> int:
        return int(torch.argmax(self.gates.detach()).item())

    def confidence(self) -> float:
        return float(self.probs().detach().max().item())

    def entropy(self) -> torch.Tensor:
        p = self.probs()
        return -(p * torch.log(p.clamp_min(1e-12))).sum()

    def expected_bytes(self) -> torch.Tensor:
        """Σ_k p_k · bytes_k, differentiable w.r.t. the gates (float64 for exact byte sums)."""
        if self.baked is not None:
            return self.nbytes[self.baked]
        return (self.probs().to(torch.float64) * self.nbytes).sum()

    def candidate(self, k: int) -> torch.Tensor:
        return self._get(k)

    # -- bake -------------------------------------------------------------------------------
    def bake(self, k: int | None = None) -> int:
        """Serve candidate `k` (default: the argmax) exactly, with no mixing."""
        self.baked = self.argmax() if k is None else int(k)
        if not 0 <= self.baked < self.k:
            raise IndexError(f"{self.name}: candidate {self.baked} out of range 0..{self.k - 1}")
        return self.baked

    def unbake(self) -> None:
        self.baked = None

    # -- parametrization forward --------------------------------------------------------------
    def forward(self, _original: torch.Tensor) -> torch.Tensor:
        shared = _shared
        if shared is not None and (w := shared.get(id(self))) is not None:
            return w
        w = self._weight()
        if shared is not None:
            shared[id(self)] = w
        return w

    def _weight(self) -> torch.Tensor:
        if self.override is not None:
            p, get, k = self.override
            return get(0).to(self.dtype) if p is None else _Mix.apply(p, get, k, self.dtype)
        if self.baked is not None:
            return self._get(self.baked).to(self.dtype)
        if self.stacked is not None:
            buf = None
            if _buffers is not None and _acc_dtype(self.dtype) == self.dtype == self.stacked.dtype:
                buf = _buffers.take(self, self.shape, self.dtype, self.stacked.device)  # else a cast: fresh
            return _Mix.apply(self.probs(), self.stacked, self.k, self.dtype, None, buf)
        if isinstance(self._get, CompactCandidates) and self.dtype == torch.float32:
            buf = _buffers.take(self, self.shape, self.dtype, self._get.device) if _buffers is not None else None
            return _Mix.apply(self.probs(), self._get, self.k, self.dtype, None, buf)
        return _Mix.apply(self.probs(), self._get, self.k, self.dtype)


def attach(module: nn.Module, mq: MixedQuant) -> None:
    """Make `mq` the parametrization of `module.weight`, dropping the dense original.

    ``unsafe=True`` because the original is replaced by an empty placeholder: the candidates
    carry all the information, and keeping the float original would double the memory.
    """
    if parametrize.is_parametrized(module, "weight"):
        raise ValueError(f"{mq.name}: already parametrized")
    placeholder = nn.Parameter(torch.empty(0, dtype=mq.dtype, device=module.weight.device), requires_grad=False)
    # Untie first: for a tied embedding/head the same Parameter object sits on both modules.
    del module._parameters["weight"]
    module.register_parameter("weight", placeholder)
    parametrize.register_parametrization(module, "weight", mq, unsafe=True)


def mixed_modules(model: nn.Module) -> dict[str, MixedQuant]:
    """Every distinct MixedQuant in `model`, by its tensor name (tied ones once)."""
    out: dict[str, MixedQuant] = {}
    for m in model.modules():
        if isinstance(m, MixedQuant):
            out.setdefault(m.name, m)
    return out
