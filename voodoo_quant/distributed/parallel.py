"""Scale-out: tensor parallelism over torch.distributed, and layer-wise ``--device_map``.

Tensor parallelism (``voodoo tp --tensor_parallel N``, one process per device, started by torchrun):

* **Shards.** An adapter's ``shard_layer`` says, per parameter of a decoder layer, which dimension
  is split and how (:class:`Shard`: fused groups such as LFM2's ``[B|C|x]`` rows or Qwen3.5's
  ``[q|k|v]`` rows are split group by group, in whole heads). A Linear split on its output rows is
  *column-parallel* (its input's gradient is all-reduced); one split on its input columns is
  *row-parallel* (its output is all-reduced, its bias kept once). The embedding and the LM head
  are split by vocabulary rows.
* **Gates.** Every rank holds the same gate logits over the same menu and the *full* tensor's
  byte sizes, so the expected size, the size penalty, the bake and the polish are computed
  identically everywhere. A rank holds only its shard of every candidate; the gate gradient of a
  sharded tensor is the sum of the shards' contributions (``dL/dp_k = <dL/dW, W_k>`` is a sum over
  elements), all-reduced once per step before the optimizer (:func:`sync_gate_grads`). The sharded
  bytes sum exactly to the tensor's because a shard never cuts a quantization block: rows are
  whole, and a row-parallel split must cut every row at a block boundary of every menu type
  (:func:`plan_tp` refuses a degree that cannot, with the reason). Nothing is padded.
* **Loss.** The LM head's logits exist only as vocabulary shards; cross-entropy and
  KL(teacher‖student) are computed from them with a distributed log-sum-exp
  (``training/tp_losses.py``), chunked over tokens like the single-device path.

Autograd through the collectives follows the usual two operators: ``copy`` (forward identity,
backward all-reduce) in front of a column-parallel layer and ``reduce`` (forward all-reduce,
backward identity) after a row-parallel one. The loss is replicated on every rank, and every
quantity that depends on another rank's shard reaches the loss through a ``reduce``.

``--device_map`` (layer-wise placement in one process, no collectives) is in
:mod:`voodoo_quant.distributed.device_map`.
"""

from __future__ import annotations

import datetime
import math
import os
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, NoReturn, Sequence

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ..core import envs
from ..core import qtypes as qt
from ..core.errors import ConfigError
from ..model.lm_head import chunk_reason


# -- shards ------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Shard:
    """How one parameter is split along `dim` across ranks.

    ``groups`` are the (size, unit) pairs of the fused groups along `dim`, in order; each group is
    split into equal pieces of whole units (heads) and rank r takes piece r of every group. With
    ``even=False`` (a single group, unit 1: the vocabulary) the split is contiguous and the last
    rank may hold fewer rows.
    """

    dim: int
    groups: tuple[tuple[int, int], ...]
    even: bool = True

    @classmethod
    def rows(cls, size: int, unit: int = 1) -> "Shard":
        return cls(0, ((int(size), int(unit)),))

    @classmethod
    def cols(cls, size: int, unit: int = 1) -> "Shard":
        return cls(1, ((int(size), int(unit)),))

    @classmethod
    def fused_rows(cls, *groups: tuple[int, int]) -> "Shard":
        return cls(0, tuple((int(s), int(u)) for s, u in groups))

    @classmethod
    def vocab(cls, size: int) -> "Shard":
        return cls(0, ((int(size), 1),), even=False)

    @property
    def size(self) -> int:
        return sum(s for s, _ in self.groups)

    def why_not(self, world: int) -> str | None:
        """None when `world` ranks can take this split, else the reason."""
        if self.even:
            for size, unit in self.groups:
                if size % unit or (size // unit) % world:
                    return f"{size // max(unit, 1)} unit(s) of {unit} do not split evenly into {world} ranks"
            return None
        if math.ceil(self.size / world) * (world - 1) >= self.size:
            return f"{self.size} rows leave a rank empty at {world} ranks"
        return None

    def piece(self, world: int) -> list[int]:
        """The per-rank piece length of every group (even splits)."""
        return [size // world for size, _ in self.groups]

    def bounds(self, rank: int, world: int) -> list[tuple[int, int]]:
        """[lo, hi) ranges along `dim` held by `rank` (one per group)."""
        if not self.even:
            step = math.ceil(self.size / world)
            return [(rank * step, min(self.size, (rank + 1) * step))]
        out, start = [], 0
        for size, _ in self.groups:
            n = size // world
            out.append((start + rank * n, start + (rank + 1) * n))
            start += size
        return out

    def index(self, rank: int, world: int) -> torch.Tensor:
        return torch.cat([torch.arange(lo, hi) for lo, hi in self.bounds(rank, world)])

    def take(self, t: torch.Tensor, rank: int, world: int) -> torch.Tensor:
        """This rank's part of `t` (a view-free copy, contiguous)."""
        if t.shape[self.dim] != self.size:
            raise ConfigError(f"shard of {self.size} along dim {self.dim} does not fit a tensor of shape {tuple(t.shape)}")
        return t.index_select(self.dim, self.index(rank, world).to(t.device)).contiguous()


@dataclass
class LayerShard:
    """What an adapter's ``shard_layer`` returns for one decoder layer: the split of each of its
    parameters (names relative to the layer) and the module attributes that change with the
    per-rank head counts (module name relative to the layer -> {attribute: value})."""

    params: dict[str, Shard] = field(default_factory=dict)
    attrs: dict[str, dict[str, Any]] = field(default_factory=dict)


def launched_rank() -> int:
    """This process's rank when torchrun started it (``RANK``), else 0."""
    try:
        return int(os.environ.get("RANK", "0"))
    except ValueError:
        return 0


def shutdown(*, sync: bool = False) -> None:
    """Destroy the default process group if one is up (a rank exiting with it alive can abort
    in gloo's teardown: "terminate called without an active exception"). With `sync` (every rank
    finished its work) the ranks first meet at a barrier: a rank that tears down while another is
    still inside the last collective or writing the outputs aborts the same way. After an error
    there is no barrier (the other ranks may never reach it)."""
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        if sync:
            dist.barrier()
        dist.destroy_process_group()


def leave() -> NoReturn:
    """End a rank whose work is done and written: meet the other ranks, destroy the group, flush
    the standard streams and the log handlers, and exit 0 without the interpreter's teardown. Even
    after a met barrier and a destroyed group, gloo's threads can still abort a rank while the
    interpreter and the C++ statics are torn down ("terminate called without an active exception",
    SIGABRT: seen in CI once in several hundred 2-rank runs); the outputs were already complete,
    but torchrun reported the rank as failed. Only a rank's entry point may call this."""
    import logging
    import sys

    shutdown(sync=True)
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    logging.shutdown()
    os._exit(0)


# -- process group -----------------------------------------------------------------------------
@dataclass
class TPContext:
    """This process's place in the tensor-parallel group (torch.distributed's default group)."""

    rank: int
    world: int

    @classmethod
    def current(cls, expect_world: int, backend: str = "gloo") -> "TPContext":
        """The initialized default group, initializing it from torchrun's environment if needed
        (`backend`: gloo for CPU ranks, nccl for CUDA / ROCm ones)."""
        import torch.distributed as dist

        if not dist.is_available():
            raise ConfigError("this torch build has no torch.distributed; tensor parallelism is unavailable")
        if not dist.is_initialized():
            if "RANK" not in os.environ or "WORLD_SIZE" not in os.environ:
                raise ConfigError(f"--tensor_parallel {expect_world} runs under torchrun: use "
                                  f"`voodoo tp --tensor_parallel {expect_world} -- <train flags>`")
            if backend == "nccl":
                torch.cuda.set_device(int(os.environ.get("LOCAL_RANK", "0")))
            # rank 0 alone fills the candidate cache and computes the sensitivity table while the
            # others wait at a barrier: longer than torch's default timeouts on a large model
            dist.init_process_group(backend, timeout=datetime.timedelta(minutes=envs.tp_timeout_min()))
        world = dist.get_world_size()
        if world != expect_world:
            raise ConfigError(f"--tensor_parallel {expect_world} but the process group has {world} processes")
        return cls(dist.get_rank(), world)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def all_reduce(self, t: torch.Tensor, op: str = "sum") -> torch.Tensor:
        import torch.distributed as dist

        dist.all_reduce(t, op=dist.ReduceOp.MAX if op == "max" else dist.ReduceOp.SUM)
        return t

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def all_gather(self, t: torch.Tensor) -> list[torch.Tensor]:
        """Every rank's `t` (same shape and dtype on every rank), in rank order."""
        import torch.distributed as dist

        out = [torch.empty_like(t) for _ in range(self.world)]
        dist.all_gather(out, t.contiguous())
        return out

    def all_gather_object(self, obj: Any) -> list[Any]:
        import torch.distributed as dist

        out: list[Any] = [None] * self.world
        dist.all_gather_object(out, obj)
        return out


class _Copy(torch.autograd.Function):
    """Forward identity; backward all-reduce (the input of a column-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        ctx.tp = tp
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return ctx.tp.all_reduce(g.contiguous().clone()), None


class _Reduce(torch.autograd.Function):
    """Forward all-reduce (sum); backward identity (the output of a row-parallel layer)."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, tp: TPContext) -> torch.Tensor:  # type: ignore[override]
        return tp.all_reduce(x.contiguous().clone())

    @staticmethod
    def backward(ctx, g: torch.Tensor):  # type: ignore[override]
        return g, None


def tp_copy(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Copy.apply(x, tp)


def tp_reduce(x: torch.Tensor, tp: TPContext) -> torch.Tensor:
    return _Reduce.apply(x, tp)


# -- planning ----------------------------------------------------------------------------------
@dataclass
class TPPlan:
    """Every split of one model (full parameter names) and the attribute changes per module."""

    world: int
    params: dict[str, Shard]
    attrs: dict[str, dict[str, Any]]
    vocab_modules: tuple[str, ...]  # embedding / LM head modules split by vocabulary rows

    def shard_of(self, name: str) -> Shard | None:
        return self.params.get(name)


def decoder_layers(model: nn.Module) -> tuple[str, nn.ModuleList]:
    """The decoder's layer list (the ModuleList named ``...layers``) and its qualified name."""
    for name, mod in model.named_modules():
        if isinstance(mod, nn.ModuleList) and name.split(".")[-1] == "layers" and len(mod):
            return name, mod
    raise ConfigError(f"cannot find the decoder layers of {type(model).__name__} (no ModuleList named 'layers')")


def plan_tp(model: nn.Module, adapter, world: int, plans: Sequence[Any] = ()) -> TPPlan:
    """The tensor-parallel split of `model` at degree `world`, validated before any weight moves.

    Refuses, with the reason: an adapter without ``shard_layer``; a model whose logits are not
    ``lm_head(hidden)``; a split that is not whole heads per rank; a row-parallel split that would
    cut a row inside a quantization block of one of that tensor's menu types. Call it on the
    plain model, before the gates are attached."""
    if world < 2:
        raise ConfigError(f"tensor parallelism needs at least 2 ranks, got {world}")
    if not getattr(adapter, "supports_tp", False):
        raise ConfigError(f"tensor parallelism needs an architecture adapter with shard_layer; "
                          f"{getattr(adapter, 'name', type(adapter).__name__)!r} has none (train on one device)")
    why = chunk_reason(model)
    if why is not None:
        raise ConfigError(f"tensor parallelism computes the loss from vocabulary shards of lm_head(hidden); here {why}")
    prefix, layers = decoder_layers(model)
    params: dict[str, Shard] = {}
    attrs: dict[str, dict[str, Any]] = {}
    for i, layer in enumerate(layers):
        ls = adapter.shard_layer(layer, world)
        for rel, sh in ls.params.items():
            params[f"{prefix}.{i}.{rel}"] = sh
        for rel, a in ls.attrs.items():
            attrs[f"{prefix}.{i}.{rel}" if rel else f"{prefix}.{i}"] = dict(a)
    names = {id(m): n for n, m in model.named_modules()}
    vocab: list[str] = []
    for getter in ("get_input_embeddings", "get_output_embeddings"):
        mod = getattr(model, getter)() if hasattr(model, getter) else None
        if mod is None:
            raise ConfigError(f"tensor parallelism needs {getter.split('_', 1)[1].replace('_', ' ')}; the model has none")
        mname = names[id(mod)]
        params[f"{mname}.weight"] = Shard.vocab(mod.weight.shape[0])
        vocab.append(mname)
    full = dict(_named_weights(model))
    for name, sh in params.items():
        if name not in full:
            raise ConfigError(f"shard_layer names {name}, which the model does not have")
        t = full[name]
        if t.shape[sh.dim] != sh.size:
            raise ConfigError(f"shard of {name}: {sh.size} along dim {sh.dim}, the tensor has shape {tuple(t.shape)}")
        why = sh.why_not(world)
        if why:
            raise ConfigError(f"--tensor_parallel {world} cannot split {name}: {why}")
    by_plan = {p.name: p for p in plans}
    for p in plans:
        for m in p.modules:  # tied weights: every module's name for the one plan
            by_plan.setdefault(f"{m}.weight", p)
    for name, sh in params.items():
        p = by_plan.get(name)
        if p is None or sh.dim == 0:
            continue
        for t in p.menu.types:
            blk = qt.get(t).block
            for piece in sh.piece(world):
                if piece % blk:
                    raise ConfigError(
                        f"--tensor_parallel {world} cannot split {name} on quantization blocks: each rank would hold "
                        f"{piece} of its {sh.size} columns, not a multiple of {t}'s block of {blk}; use a degree that "
                        f"divides {sh.size // blk} blocks, or drop {t} from that tensor's menu")
    return TPPlan(world, params, attrs, tuple(dict.fromkeys(vocab)))


def _named_weights(model: nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    yield from model.named_parameters(remove_duplicate=False)
    yield from model.named_buffers(remove_duplicate=False)


# -- applying ----------------------------------------------------------------------------------
def apply_tp(model: nn.Module, plan: TPPlan, tp: TPContext, *, gated: Iterable[str] = ()) -> None:
    """Split `model` in place for rank `tp.rank`.

    Plain parameters are replaced by this rank's part; weights in `gated` (MixedQuant
    parametrizations, whose candidates were sharded when they were built) are left alone. Hooks
    make Linear layers column- or row-parallel and the embedding vocabulary-parallel; the
    attribute changes (per-rank head counts) are applied."""
    gated = set(gated)
    mods = dict(model.named_modules())
    done: set[int] = set()
    for name, sh in plan.params.items():
        mname, pname = name.rsplit(".", 1)
        mod = mods[mname]
        if name not in gated and not (pname == "weight" and parametrize.is_parametrized(mod, "weight")):
            p = getattr(mod, pname)
            if id(p) not in done:  # a tied weight is split once
                new = nn.Parameter(sh.take(p.data, tp.rank, tp.world), requires_grad=False)
                for other in mods.values():
                    for k, v in list(other._parameters.items()):
                        if v is p:
                            other._parameters[k] = new
                done.add(id(new))
        if pname == "weight" and mname not in plan.vocab_modules and isinstance(mod, nn.Linear):
            _make_parallel_linear(mod, sh, tp)
    for mname in plan.vocab_modules:
        mod = mods[mname]
        sh = plan.params[f"{mname}.weight"]
        lo, hi = sh.bounds(tp.rank, tp.world)[0]
        if isinstance(mod, nn.Embedding):
            _make_vocab_embedding(mod, lo, hi, tp)
        elif isinstance(mod, nn.Linear):
            mod._tp_vocab = (lo, hi)  # the loss reads its shard directly (training/tp_losses.py)
        else:
            raise ConfigError(f"{mname} is a {type(mod).__name__}; vocabulary parallelism knows Embedding and Linear")
    for mname, a in plan.attrs.items():
        for k, v in a.items():
            setattr(mods[mname], k, v)


def _make_parallel_linear(mod: nn.Linear, sh: Shard, tp: TPContext) -> None:
    if sh.dim == 0:  # column-parallel (a bias is split by its own entry in the plan)
        mod.register_forward_pre_hook(lambda m, args: (tp_copy(args[0], tp), *args[1:]))
    else:  # row-parallel: partial sums all-reduced; the bias is added once (rank 0)
        if mod.bias is not None and not tp.is_main:
            mod.bias = nn.Parameter(torch.zeros_like(mod.bias), requires_grad=False)
        mod.register_forward_hook(lambda m, args, out: tp_reduce(out, tp))


def _make_vocab_embedding(mod: nn.Embedding, lo: int, hi: int, tp: TPContext) -> None:
    mod.num_embeddings = hi - lo
    mod.padding_idx = None  # only shapes the weight's gradient, which is frozen

    def pre(m, args):
        ids = args[0]
        m._tp_mask = (ids >= lo) & (ids < hi)
        return ((ids - lo).masked_fill(~m._tp_mask, 0), *args[1:])

    def post(m, args, out):
        out = out * m._tp_mask.unsqueeze(-1).to(out.dtype)
        m._tp_mask = None
        return tp_reduce(out, tp)

    mod.register_forward_pre_hook(pre)
    mod.register_forward_hook(post)


def sync_gate_grads(gates: Sequence[torch.Tensor], tp: TPContext) -> None:
    """Sum the shards' gate gradients (one all-reduce for all tensors), in place."""
    grads = [g.grad if g.grad is not None else torch.zeros_like(g) for g in gates]
    if not grads:
        return
    flat = torch.cat([x.reshape(-1) for x in grads])
    tp.all_reduce(flat)
    off = 0
    for g, x in zip(gates, grads):
        n = x.numel()
        g.grad = flat[off:off + n].view_as(x).clone()
        off += n


def check_same_choice(choice: Mapping[str, int | str], tp: TPContext) -> None:
    """Every rank must bake the same assignment (same gates, same deterministic bake): tensor ->
    menu index, or tensor -> type after the guarantee and the search."""
    mine = sorted(choice.items())
    every = tp.all_gather_object(mine)
    if any(o != mine for o in every):
        bad = [r for r, o in enumerate(every) if o != mine]
        raise RuntimeError(f"tensor-parallel ranks {bad} baked another assignment than rank {tp.rank}")
