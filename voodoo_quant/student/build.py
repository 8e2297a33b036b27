"""Plan the selectable tensors of a model, build their candidates, and turn it into a student.

A tensor is selectable if it is the 2-D weight of an ``nn.Linear`` or ``nn.Embedding``
(tied weights count once). Its GGUF layout (row length, name) comes from a *layout provider*;
without one, the weight's own rows are the GGUF rows, which is how llama.cpp stores a Linear
(ne[0] = in_features) and an embedding (ne[0] = hidden).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping, Protocol, Sequence

import numpy as np
import torch
import torch.nn as nn

from .. import quants
from ..arch.base import ArchAdapter
from ..candidates import compensate
from ..candidates.compact import CompactCandidates
from ..candidates.compensate import applies, compensation_of
from ..candidates.precache import CandidateJob
from ..core import ggml
from ..core import qtypes as qt
from ..core.errors import ConfigError
from ..gguf.layout import find_layout, ggml_n_dims, llama_quantize_allows, model_layouts
from ..selection.menus import Menu, MenuConfig, build_menu
from .layers import MixedQuant, attach

log = logging.getLogger(__name__)


class Layout(Protocol):
    """Maps a tensor between its HF layout and the 2-D matrix llama.cpp stores."""

    gguf_name: str | None
    rows: int
    n_per_row: int

    def to_gguf(self, w: torch.Tensor) -> np.ndarray: ...  # float32, (rows, n_per_row), C-contiguous

    def from_gguf(self, m: torch.Tensor) -> torch.Tensor: ...  # back to the HF shape


@dataclass
class IdentityLayout:
    gguf_name: str | None
    shape: tuple[int, ...]

    @property
    def n_per_row(self) -> int:
        return self.shape[-1]

    @property
    def rows(self) -> int:
        return int(np.prod(self.shape[:-1]))

    @property
    def is_identity(self) -> bool:
        """The HF tensor's flat order is the GGUF's."""
        return True

    def to_gguf(self, w: torch.Tensor) -> np.ndarray:
        return np.ascontiguousarray(w.detach().to(torch.float32).cpu().reshape(self.rows, self.n_per_row).numpy())

    def from_gguf(self, m: torch.Tensor) -> torch.Tensor:
        return m.reshape(self.shape)


@dataclass
class TensorPlan:
    name: str  # HF parameter name (first of tied names)
    shape: tuple[int, ...]
    role: str  # "attention" | "other"
    layout: Layout
    menu: Menu
    sizes: tuple[int, ...]  # exact GGUF bytes per menu rung
    modules: list[str] = field(default_factory=list)  # module names using this weight

    @property
    def gguf_name(self) -> str | None:
        return self.layout.gguf_name

    @property
    def rows(self) -> int:
        return self.layout.rows

    @property
    def n_per_row(self) -> int:
        return self.layout.n_per_row

    def dequantize(self, blob: bytes, qtype: str) -> torch.Tensor:
        """The float32 weight (HF layout) that a rung's ggml bytes dequantize to, by libggml-base."""
        deq = ggml.lib().dequantize(blob, qtype, (self.rows, self.n_per_row), name=self.name)
        return self.layout.from_gguf(torch.from_numpy(deq))


def selectable_weights(model: nn.Module) -> dict[str, tuple[nn.Parameter, list[str]]]:
    """name -> (weight, [module names]) for every 2-D Linear/Embedding weight, tied ones once."""
    by_id: dict[int, tuple[str, nn.Parameter, list[str]]] = {}
    for mname, mod in model.named_modules():
        if isinstance(mod, (nn.Linear, nn.Embedding)):
            w = mod.weight
            if not isinstance(w, torch.Tensor) or w.dim() != 2 or w.numel() == 0:
                continue
            pname = f"{mname}.weight" if mname else "weight"
            entry = by_id.setdefault(id(w), (pname, w, []))
            entry[2].append(mname)
    return {name: (w, mods) for name, w, mods in by_id.values()}


LayoutProvider = Callable[[str, tuple[int, ...]], "Layout | None"]


@dataclass
class ConverterLayout:
    """A :class:`voodoo_quant.gguf.layout.TensorLayout` (learned from llama.cpp's converter) seen
    through the :class:`Layout` protocol: the GGUF name, rows and row length are the converter's,
    and candidates are mapped back to the HF layout by the exact inverse permutation."""

    inner: object  # TensorLayout

    @property
    def gguf_name(self) -> str:
        return self.inner.gguf_name

    @property
    def rows(self) -> int:
        return self.inner.n_rows

    @property
    def n_per_row(self) -> int:
        return self.inner.n_per_row

    @property
    def is_identity(self) -> bool:
        return bool(self.inner.is_identity)

    def to_gguf(self, w: torch.Tensor) -> np.ndarray:
        return self.inner.to_gguf(w.detach().to(torch.float32).cpu())

    def from_gguf(self, m: torch.Tensor) -> torch.Tensor:
        return self.inner.from_gguf_torch(m)


def converter_layouts(model_dir: str) -> LayoutProvider | None:
    """A layout provider from llama.cpp's own converter for `model_dir`, or None when the
    converter does not know the model (then rows are taken as they are; export is impossible)."""
    unmapped: dict[str, tuple[int, ...]] = {}
    try:
        layouts = model_layouts(model_dir, unmapped=unmapped)
    except Exception as e:  # the converter refuses the architecture, or no HF dir
        log.warning("llama.cpp's converter cannot map %s (%s); using the weights' own rows", model_dir,
                    (str(e).splitlines() or [type(e).__name__])[0])
        return None

    def provider(name: str, shape: tuple[int, ...]):
        lay = find_layout(layouts, name)
        if lay is None or not lay.quantizable:
            return None  # the converter drops it or llama-quantize never quantizes it
        return ConverterLayout(lay)

    provider.layouts = layouts
    provider.unmapped = unmapped
    return provider


def fixed_tensors(plans: Sequence["TensorPlan"], layout_for) -> dict[str, tuple[int, ...]]:
    """{GGUF name: shape} of the tensors stock llama-quantize would quantize that no plan covers
    (not a Linear/Embedding weight, or a converter transform that is no permutation: a MoE's
    merged expert stacks). Export writes them as llama-quantize's base type (``budget.BASE_TYPE``)
    and the budget counts them. Empty without the converter's layout map."""
    planned = {p.gguf_name for p in plans}
    out: dict[str, tuple[int, ...]] = {}
    for lay in getattr(layout_for, "layouts", {}).values():
        if lay.quantizable and lay.gguf_name not in planned:
            out[lay.gguf_name] = tuple(lay.gguf_shape)
    for name, shape in getattr(layout_for, "unmapped", {}).items():
        if name not in planned and llama_quantize_allows(name, ggml_n_dims(shape[::-1])):
            out[name] = tuple(shape)
    return dict(sorted(out.items()))


def plan_model(
    model: nn.Module,
    adapter: ArchAdapter,
    menus: MenuConfig,
    *,
    imatrix_names: Iterable[str] | None = None,
    layout_for: LayoutProvider | None = None,
) -> list[TensorPlan]:
    """The selectable tensors with their roles, GGUF layouts and menus."""
    covered = set(imatrix_names or ())
    plans: list[TensorPlan] = []
    dropped: dict[str, list[str]] = {}  # type -> the tensors whose menus lost it (no imatrix covers them)
    for name, (w, mods) in selectable_weights(model).items():
        shape = tuple(int(s) for s in w.shape)
        layout = layout_for(name, shape) if layout_for else IdentityLayout(adapter.gguf_name(name), shape)
        if layout is None:
            log.info("%s: not selectable (no GGUF tensor llama-quantize would quantize)", name)
            continue
        role = "attention" if adapter.is_attention(name) else "other"
        has_im = layout.gguf_name is not None and layout.gguf_name in covered
        menu = build_menu(menus.types_for(role), layout.n_per_row, has_im, fill=menus.fill)
        for t in menu.dropped_no_imatrix:
            dropped.setdefault(t, []).append(name)
        if not menu.types:
            raise ConfigError(
                f"{name}: no candidate type is left on its menu (asked {', '.join(menu.requested)}; "
                f"dropped for lack of an imatrix: {', '.join(menu.dropped_no_imatrix)}); pass --imatrix or add types"
            )
        sizes = tuple(qt.get(t).row_bytes(layout.n_per_row) * layout.rows for t in menu.types)
        plans.append(TensorPlan(name, shape, role, layout, menu, sizes, mods))
    for t, names in dropped.items():  # one line per type, not one per tensor
        log.warning("dropped %s from the menus of %d tensor(s) that no imatrix covers (%s%s); "
                    "pass --imatrix to keep it", t, len(names), names[0], f" … {names[-1]}" if len(names) > 1 else "")
    if not plans:
        raise ConfigError("the model has no selectable tensors (2-D Linear or Embedding weights)")
    return plans


QuantizeFn = Callable[[np.ndarray, str, np.ndarray | None, str], bytes]


def direct_quantize(matrix: np.ndarray, qtype: str, imatrix: np.ndarray | None, name: str) -> bytes:
    return ggml.lib().quantize(matrix, qtype, imatrix, name=name)


@dataclass
class PackedCandidates:
    """A tensor's candidates as their ggml bytes; dequantized on demand on `device`."""

    plan: TensorPlan
    packed: list[torch.Tensor]  # uint8, one per menu rung
    dtype: torch.dtype

    def __call__(self, k: int) -> torch.Tensor:
        t = self.plan.menu.types[k]
        m = quants.dequantize(self.packed[k], t, (self.plan.rows, self.plan.n_per_row))
        return self.plan.layout.from_gguf(m).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.packed)

    @property
    def device(self) -> torch.device:
        return self.packed[0].device

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.plan.shape)

    @property
    def row_reader(self):
        """(k, lo, hi) -> HF rows lo:hi of candidate k, dequantized from those rows' bytes alone,
        where the GGUF rows are the HF rows in order (an identity layout, as the embedding and
        the LM head have); else None (layers._Mix then mixes the tensor whole)."""
        lay = self.plan.layout
        inner = getattr(lay, "inner", None)
        if len(self.plan.shape) != 2 or (inner is not None and not inner.is_identity) or \
                (inner is None and not isinstance(lay, IdentityLayout)):
            return None
        return self._rows

    def _rows(self, k: int, lo: int, hi: int) -> torch.Tensor:
        t = self.plan.menu.types[k]
        rb = qt.get(t).row_bytes(self.plan.n_per_row)
        m = quants.dequantize(self.packed[k][lo * rb:hi * rb], t, (hi - lo, self.plan.n_per_row))
        return m.to(self.dtype)


@dataclass
class ShardedPacked:
    """One tensor-parallel rank's lazy candidates: the ggml bytes of only the GGUF rows (a
    column-parallel shard) or the whole blocks of every row (a row-parallel shard) that the rank's
    part of the HF tensor comes from, dequantized on demand and put in HF order by two index
    selections. Where the converter's layout scatters a shard across blocks (a transposed or
    general permutation, or columns whose blocks the shard shares with another rank, as Qwen3.5's
    value-head reorder of ssm_out can), the rank keeps the whole tensor's bytes and slices after
    dequantizing: exact either way, and `full_fallback` says which path a tensor took."""

    types: tuple[str, ...]
    packed: list[torch.Tensor]
    sub_shape: tuple[int, int]  # (rows, row length) of the held bytes
    row_sel: torch.Tensor | None
    col_sel: torch.Tensor | None
    shape: tuple[int, ...]
    dtype: torch.dtype
    fallback: Callable[[torch.Tensor], torch.Tensor] | None = None
    full_fallback: bool = False

    def __call__(self, k: int) -> torch.Tensor:
        m = quants.dequantize(self.packed[k], self.types[k], self.sub_shape)
        if self.fallback is not None:
            return self.fallback(m).to(self.dtype)
        if self.row_sel is not None:
            m = m.index_select(0, self.row_sel)
        if self.col_sel is not None:
            m = m.index_select(1, self.col_sel)
        return m.reshape(self.shape).to(self.dtype)

    @property
    def nbytes(self) -> int:
        return sum(p.numel() for p in self.packed)

    @property
    def device(self) -> torch.device:
        return self.packed[0].device

    @property
    def row_reader(self):
        """(k, lo, hi) -> this rank's HF rows lo:hi of candidate k from those rows' bytes alone
        (the held bytes are whole rows, one per HF row after `row_sel`); None for a scattered
        shard (the whole tensor's bytes, dequantized then sliced)."""
        return None if self.fallback is not None or len(self.shape) != 2 else self._rows

    def _rows(self, k: int, lo: int, hi: int) -> torch.Tensor:
        held = self.packed[k].reshape(self.sub_shape[0], -1)
        part = held[lo:hi] if self.row_sel is None else held.index_select(0, self.row_sel[lo:hi])
        m = quants.dequantize(part.contiguous(), self.types[k], (hi - lo, self.sub_shape[1]))
        if self.col_sel is not None:
            m = m.index_select(1, self.col_sel)
        return m.to(self.dtype)

    @classmethod
    def build(cls, plan: TensorPlan, blobs: Sequence[bytes], shard, rank: int, world: int,
              device, dtype: torch.dtype, types: Sequence[str] | None = None) -> "ShardedPacked":
        """`blobs` of the menu's rungs, or of `types` (the guarantee's off-menu candidates)."""
        types = tuple(plan.menu.types if types is None else types)
        R, C = plan.rows, plan.n_per_row
        sel = shard.index(rank, world).numpy()
        full_shape = tuple(plan.shape)
        shape = tuple(len(sel) if d == shard.dim else n for d, n in enumerate(full_shape))
        inner = getattr(plan.layout, "inner", None)
        rows = getattr(inner, "rows", None)
        cols = getattr(inner, "cols", None)
        simple = len(full_shape) == 2 and (inner is None or (not inner.transposed and inner.gather is None))
        raw = [np.frombuffer(b, dtype=np.uint8) for b in blobs]

        def as_t(a) -> torch.Tensor:
            return torch.from_numpy(np.ascontiguousarray(a)).to(device)

        def idx(a) -> torch.Tensor:
            return torch.as_tensor(np.asarray(a, dtype=np.int64), device=device)

        if simple:
            src_rows = np.arange(R) if rows is None else np.asarray(rows)  # GGUF row i holds HF row src_rows[i]
            src_cols = np.arange(C) if cols is None else np.asarray(cols)
            if shard.dim == 0:
                pos_of = np.full(R, -1, dtype=np.int64)
                pos_of[src_rows] = np.arange(R)  # HF row -> GGUF row
                g_rows = np.sort(pos_of[sel])
                where = np.full(R, -1, dtype=np.int64)
                where[g_rows] = np.arange(len(g_rows))
                row_sel = where[pos_of[sel]]
                inv_cols = None if cols is None else np.argsort(src_cols)
                packed = [as_t(r.reshape(R, -1)[g_rows]) for r in raw]
                return cls(types, packed, (len(g_rows), C), idx(row_sel), None if inv_cols is None else idx(inv_cols),
                           shape, dtype)
            gpos = np.full(C, -1, dtype=np.int64)
            gpos[src_cols] = np.arange(C)  # HF col -> GGUF col
            g_cols = np.sort(gpos[sel])
            aligned = all(_whole_blocks(g_cols, qt.get(t).block) for t in types)
            if aligned:
                where = np.full(C, -1, dtype=np.int64)
                where[g_cols] = np.arange(len(g_cols))
                packed = []
                for r, t in zip(raw, types):
                    q = qt.get(t)
                    blocks = np.unique(g_cols // q.block)
                    packed.append(as_t(r.reshape(R, C // q.block, q.type_size)[:, blocks].reshape(R, -1)))
                inv_rows = None if rows is None else np.argsort(src_rows)
                return cls(types, packed, (R, len(g_cols)), None if inv_rows is None else idx(inv_rows),
                           idx(where[gpos[sel]]), shape, dtype)
        # scattered: whole tensor's bytes, dequantize then slice
        index = shard.index(rank, world).to(device)

        def fallback(m: torch.Tensor) -> torch.Tensor:
            return plan.layout.from_gguf(m).index_select(shard.dim, index).contiguous()

        return cls(types, [as_t(r) for r in raw], (R, C), None, None, shape, dtype, fallback=fallback, full_fallback=True)


def _whole_blocks(cols: np.ndarray, block: int) -> bool:
    """Sorted GGUF columns that are a union of whole `block`-wide blocks."""
    if len(cols) % block:
        return False
    b = cols.reshape(-1, block)
    return bool((b[:, 0] % block == 0).all() and (b == b[:, :1] + np.arange(block)).all())


def candidate_bytes(
    plan: TensorPlan,
    weight: torch.Tensor,
    imatrix: Mapping[str, np.ndarray] | None,
    quantize: QuantizeFn = direct_quantize,
) -> list[bytes]:
    """The ggml bytes of every rung of `plan`'s menu, quantized from the GGUF-layout matrix
    (error-compensated per type when `imatrix` is a QuantInputs carrying the tensor's
    compensation, compensate.py)."""
    m = plan.layout.to_gguf(weight)
    vec = None
    if imatrix is not None and plan.gguf_name is not None:
        vec = imatrix.get(plan.gguf_name)
    comp = compensation_of(imatrix, plan.name)
    out = []
    for t in plan.menu.types:
        q = qt.get(t)
        use = vec if vec is not None and not q.is_float else None
        src, data = compensate.compensated(m, q, use, comp) if comp is not None and applies(q) else (m, None)
        out.append(data if data is not None else quantize(src, t, use, plan.name))  # data: the walk wrote the bytes
    return out


def candidate_jobs(plans: Sequence[TensorPlan], weights: Mapping[str, torch.Tensor],
                   imatrix: Mapping[str, np.ndarray] | None) -> list:
    """One cache-build job per (tensor, menu rung), with the tensor's GGUF-layout matrix."""
    jobs = []
    for plan in plans:
        w = weights[plan.name]
        vec = imatrix.get(plan.gguf_name) if imatrix is not None and plan.gguf_name is not None else None
        comp = compensation_of(imatrix, plan.name)
        provider = (lambda lay=plan.layout, w=w: lay.to_gguf(w))
        for t in plan.menu.types:
            use = vec if vec is not None and not qt.get(t).is_float else None
            jobs.append(CandidateJob(plan.name, t, provider=provider, imatrix=use, compensation=comp))
    return jobs


def build_mixed(
    plan: TensorPlan,
    blobs: Sequence[bytes],
    *,
    lazy: bool,
    dtype: torch.dtype,
    device: torch.device | str = "cpu",
    init_logits: torch.Tensor | None = None,
    shard=None,
    rank: int = 0,
    world: int = 1,
    compact: bool = True,
) -> MixedQuant:
    """A MixedQuant for `plan` from its candidates' bytes (eager: dequantized now, and on the CPU in
    float32 kept as int8 codes where `compact` and :class:`CompactCandidates` reproduce them
    exactly, else a float32 stack; lazy: packed).
    With a `shard` (tensor parallelism, eager only) it holds rank `rank`'s part of every candidate
    and keeps the whole tensor's byte sizes, so every rank's gates see the same budget."""
    if shard is not None and lazy:
        cands_fn = ShardedPacked.build(plan, blobs, shard, rank, world, device, dtype)
        return MixedQuant(plan.name, plan.menu.types, plan.sizes, cands_fn, cands_fn.shape, dtype=dtype,
                          init_logits=init_logits, device=device)
    if shard is not None:
        dense = [shard.take(plan.dequantize(b, t), rank, world) for b, t in zip(blobs, plan.menu.types)]
        cands = torch.stack(dense).to(device=device, dtype=dtype)
        return MixedQuant(plan.name, plan.menu.types, plan.sizes, cands, tuple(dense[0].shape), dtype=dtype,
                          init_logits=init_logits, device=device)
    if lazy:
        packed = [torch.frombuffer(bytearray(b), dtype=torch.uint8).to(device) for b in blobs]
        cands: torch.Tensor | PackedCandidates | CompactCandidates = PackedCandidates(plan, packed, dtype)
    else:
        dense = [plan.dequantize(b, t) for b, t in zip(blobs, plan.menu.types)]
        held = None
        if compact and dtype == torch.float32 and torch.device(device).type == "cpu":
            held = CompactCandidates.build(plan, blobs, dense)  # None: not exactly representable
        cands = held if held is not None else torch.stack(dense).to(device=device, dtype=dtype)
    return MixedQuant(plan.name, plan.menu.types, plan.sizes, cands, plan.shape, dtype=dtype, init_logits=init_logits,
                      device=device)


def attach_all(model: nn.Module, plans: Sequence[TensorPlan], mixed: Mapping[str, MixedQuant]) -> None:
    """Register every MixedQuant on the modules that use its weight (tied ones share one)."""
    modules = dict(model.named_modules())
    for plan in plans:
        for mname in plan.modules:
            attach(modules[mname], mixed[plan.name])


def prior_logits(plan: TensorPlan, target_bpw: float, sharpness: float = 1.0) -> torch.Tensor:
    """Gate init: a Gaussian prior in bits around the target, so training starts near budget.

    g_k = −sharpness · (bpw_k − target_bpw)²; at τ = 1 the expected size starts close to the
    target instead of at the menu's mean, and every rung keeps a non-zero probability.
    """
    bpw = torch.tensor([8.0 * s / (plan.rows * plan.n_per_row) for s in plan.sizes])
    return -sharpness * (bpw - target_bpw) ** 2
