"""Error compensation: the weights handed to llama.cpp's quantizer, adjusted so that each block's
rounding error is absorbed by the columns not yet quantized (GPTQ's update, with libggml-base's
own quantizer as the rounding oracle).

A candidate stays what the product's contract says it is: bytes of libggml-base's format whose
values the training, the bake and llama.cpp all read alike. Without compensation they are what
``ggml_quantize_chunk`` writes for the float32 weight W, with the run's imatrix vector. With
compensation they are its bytes for W', built block by block along the row (columns in GGUF
order), or, for the superblock types whose codes the walk rounds itself, that quantization's
scales with the walk's codes written in (below):

    for each step of columns (see below):
        Q   = to_float(quantize(W'[:, the block holding the step]))[:, step]   # the quantizer's rounding
        E   = (W'[:, step] − Q) · U[step, step]⁻¹
        W'[:, later] −= E · U[step, later]

where U is the upper Cholesky factor of (H + λ·mean(diag H)·I)⁻¹ and H = Σ xᵀx over the layer's
inputs on calibration text (the fixed and packed sweeps hold M = U⁻¹, from one Cholesky of H, and
read U a group's diagonal block at a time: :func:`compensation_walk.sweep_fixed`). This minimizes
‖(W − Ŵ) X‖² one block at a time (Frantar et al., GPTQ, with a ggml block's columns fixed at once
because they share a scale). A step is a block of 32, or one 32-column sub-block of a 256-weight
superblock. How the step's rounding Q is obtained is the sweep (:attr:`Compensation.sweep`):

- ``"ruled"`` (:func:`compensation_walk.sweep_fixed`): a 32-block is quantized by libggml-base as
  the walk reaches it. A superblock of :data:`fixed_rounding.SWEEP_TYPES` (K-quants, IQ4_XS) is
  quantized once, when the walk reaches it; its later steps are rounded in torch with that
  quantization's scales held fixed, W' holds the rounded values, and the candidate's bytes are
  that quantization with the walk's codes written in (quants/recode.py,
  :data:`compensation_walk.WRITE_CODES`): the file holds the walk's rounding to the bit, so the
  error passed on is the file's, and no quantization of W' follows the walk. (Quantizing W'
  again gave back the walk's values in 83–99 % of 32-blocks on the 1.5B benchmark model's layer 1
  and chose its scales anew; the written bytes leave 0.92–0.97× its layer error per type, at one
  plain quantization's time less: docs/lab/2026-12-07-written-codes.md.)
  A grid IQ superblock (IQ1–IQ3, :data:`compensation_walk.RULED_SWEEP`) is quantized once when the
  walk reaches it (its first step's rounding); each later step's grid points come from
  libggml-base on a probe holding the step's columns of 8 rows side by side as one superblock,
  each position weighted as its own row's superblock weighs it, and the step's scale is coded
  against the row superblock's largest (grid_probe.py: a grid superblock's sub-block picks its
  points from its own values and the superblock's σ², and its scale from the superblock's
  largest). W' holds the updated weights.
  Measured on the 1.5B benchmark model's tensors: 1.001–1.007× the layer error of ``"fixed"``
  per type (0.998–1.013× per tensor) at 4.1–5.2× a plain candidate's time against 9.6–10.0×
  (docs/lab/2026-12-06-ruled-probe.md).
- ``"fixed"``: as ``"ruled"``, but a grid IQ superblock is quantized again at every step, a
  libggml-base call on the whole superblock for each of its 8 steps (measured with a fixed-scale
  oracle instead: 8–36 % more layer error; requantizing every 2nd–8th step only, 8–37 %).
- ``"packed"`` (the default): as ``"ruled"``, but each step of a grid IQ type of
  :data:`compensation_walk.PACKED_SWEEP` (IQ3_S, IQ2_S, IQ1_S) is rounded by the probe
  with the imatrix slice repeated (the probe's σ²) and the probe's own scale ruler; the types of
  :data:`compensation_walk.PACKED_PROXY` (IQ3_XXS, IQ2_XXS) are walked as ``"proxy"`` walks them
  (below); IQ2_XS (:data:`compensation_walk.PACKED_RULED`) as under ``"ruled"``.
  2.4–3.0× a plain candidate, and 4–75 % more layer error than ``"fixed"`` on real tensors (the
  probe's rounding is as good as the file's but not the file's); but the files' KLD on the 1.5B
  benchmark model is the same as the ruled walk's within noise at two sizes and two eval texts,
  at 0.38× its train step (docs/lab/2026-12-07-the-walk-in-files.md), so it is the default.
  :data:`compensation_walk.PACKED` walks named types so under ``"fixed"`` (a measured variant).
  float32, updates applied a group at a time; the factor from one Cholesky of the order-reversed
  H (``bench/compensation_cost.py``, ``bench/compensation_objective.py``).
- ``"proxy"`` (:func:`compensation_walk.sweep_fixed` with `proxy`): as ``"ruled"``, but a step of
  a type of :data:`proxy_rounding.TYPES` is rounded in torch by a model of the type's quantizer,
  so the walk makes no libggml-base call for it (proxy_rounding.py): Q8_0 by its reference rounding
  (the quantizer's values to the bit), Q4_K/Q5_K at 6-bit scales and mins fitted in torch when the
  walk reaches the superblock (W' holds the rounded values), IQ2_XXS by a nearest-grid-entry
  search at a few trial scales with its scale coded against a ruler fixed when the walk reaches the
  superblock, IQ3_S, IQ2_S, IQ1_S, IQ3_XXS and IQ2_XS so with W' holding each value's level at the
  coded scale (proxy_grids.py): W' holds values libggml-base gives back. The other types are
  walked as ``"ruled"`` walks them. Measured with ``bench/compensation_objective.py --sweeps
  ruled,packed,proxy`` and ``bench/proxy_synthetic.py``.
- ``"requant"`` (the walk of assignments made before the sweep was a choice): the superblock is
  quantized again after each of its sub-blocks, float64; except for the types of
  :data:`WHOLE_SUPERBLOCK`, whose superblock is one step (their sub-block scales are coded against
  the superblock's largest, so quantizing again moves the sub-blocks already fixed: measured on
  SmolLM2-135M's ffn_down, 0.69–0.72× the error of 32-column steps for Q5_K,
  ``bench/compensation_step.py``). 7–11× a plain candidate for most superblock types.

The final bytes are the quantizer's for the whole rows of W' (or, for the types the walk writes,
its codes at the quantizer's scales), so training, bake and export all see the same bytes. A
type's candidates are keyed by :meth:`Compensation.digest_for`: a change to one type's walk
leaves every other type's cached candidates valid. :func:`compensated_matrix` is deterministic (one thread); export reads the
candidate from the cache, or computes it again and checks it against the sha256 the assignment
recorded (tools/export.py).
"""

from __future__ import annotations

import hashlib
import struct
from collections import OrderedDict
from collections.abc import Mapping
from dataclasses import dataclass, field

import numpy as np

from ..core import ggml
from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from . import compensation_walk as walk

ALGORITHM = "gptq-blocks/2"  # the "requant" sweep; /2: whole-superblock steps for WHOLE_SUPERBLOCK (Q5_K)
FIXED_ALGORITHM = "gptq-fixed/2"  # the "ruled", "fixed" and "packed" sweeps (compensation_walk.py; the digest adds which)
SWEEPS = ("ruled", "fixed", "packed", "requant", "proxy")
DEFAULT_SWEEP = "packed"
DEFAULT_DAMP = 0.1
# superblock types compensated one whole superblock per step (module docstring: measured)
WHOLE_SUPERBLOCK = frozenset({"Q5_K"})


@dataclass(frozen=True)
class Compensation:
    """The inputs of one tensor's compensation: its layer input's Hessian (GGUF column order,
    float32, n × n) and the damping fraction. Its :attr:`digest` keys the candidate cache."""

    hessian: np.ndarray
    damp: float = DEFAULT_DAMP
    sweep: str = DEFAULT_SWEEP  # "fixed", "packed" (the grid IQ steps from a probe) or "requant" (one per step)
    _digest: list = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = self.hessian
        if h.ndim != 2 or h.shape[0] != h.shape[1] or h.dtype != np.float32:
            raise QuantizationInputError(f"a Hessian is a square float32 matrix, got {h.dtype} {h.shape}")
        if not (0.0 < float(self.damp) < 1e3):
            raise QuantizationInputError(f"damping fraction must be > 0, got {self.damp}")
        finite = bool(np.all(np.isfinite(h)))
        _drop_pages(h)
        if not finite:
            raise QuantizationInputError("the Hessian holds NaN or Inf")
        if self.sweep not in SWEEPS:
            raise QuantizationInputError(f"compensation sweep {self.sweep!r}: expected one of {', '.join(SWEEPS)}")

    @property
    def n(self) -> int:
        return int(self.hessian.shape[0])

    def factor(self):
        """(factor, dead): for the "requant" sweep U, the upper Cholesky factor of the damped
        inverse Hessian (float64); for the others M, with M Mᵀ the damped Hessian (float32,
        :func:`_reversed_factor`); None when no column is live; and the mask of dead columns. A process keeps the last few it computed
        (:data:`FACTOR_CACHE_BYTES` in all): a tensor's types are built one after another and
        share it, while the factors of a whole model (n² float64 each) are never held."""
        key = self.digest
        hit = _FACTORS.get(key)
        if hit is not None:
            _FACTORS.move_to_end(key)
            return hit
        f = (_cholesky_factor if self.sweep == "requant" else _reversed_factor)(self.hessian, float(self.damp))
        _drop_pages(self.hessian)
        size = 0 if f[0] is None else f[0].element_size() * self.n * self.n
        if size <= FACTOR_CACHE_BYTES:
            _FACTORS[key] = f
            while sum(u.element_size() * u.numel() for u, _ in _FACTORS.values() if u is not None) > FACTOR_CACHE_BYTES:
                _FACTORS.popitem(last=False)
        return f

    @property
    def digest(self) -> str:
        """sha256 of the algorithm (with the types it walks a whole superblock at a time), the
        damping and the Hessian's bytes (computed once): a changed walk never reads old candidates."""
        if not self._digest:
            algo = f"{ALGORITHM}|{','.join(sorted(WHOLE_SUPERBLOCK))}" if self.sweep == "requant" else FIXED_ALGORITHM
            if self.sweep == "packed":  # /2: the ruled grid types outside PACKED_SWEEP walked ruled, not per step
                algo += (f"|packed={','.join(sorted(walk.PACKED_SWEEP))}:{walk.PACK_NORM}"
                         f"|ruled={','.join(sorted(walk.PACKED_RULED))}")
            if self.sweep in ("ruled", "proxy"):
                algo += f"|ruled={','.join(sorted(walk.RULED_SWEEP))}:{walk.PACK_NORM}"
            if self.sweep == "proxy":
                from . import proxy_rounding as pr

                algo += f"|{pr.settings()}"
            elif (self.sweep == "packed" or walk.PACKED) and walk.PACK_WEIGHTS != "probe":
                algo += f"|weights={walk.PACK_WEIGHTS}"
            if self.sweep != "requant" and (walk.PACKED or walk.GRID_STEPS is not None or walk.GRID_HOLD
                                            or walk.GRID_PASSES):
                # a measured variant of the walk (bench/compensation_cost.py): never the default's entries
                algo += f"|pack={','.join(sorted(walk.PACKED))}:{walk.PACK_NORM}|steps={sorted(walk.GRID_STEPS or ())}" \
                        f"|hold={walk.GRID_HOLD}|passes={walk.GRID_PASSES}:{walk.GRID_PASS_ROUND}"
            h = hashlib.sha256(f"{algo}|{float(self.damp)!r}".encode())
            h.update(struct.pack("<q", self.n))
            h.update(memoryview(np.ascontiguousarray(self.hessian, dtype="<f4")).cast("B"))
            _drop_pages(self.hessian)
            self._digest.append(h.hexdigest())
        return self._digest[0]


    def digest_for(self, qtype: str | qt.QType) -> str:
        """The cache key of `qtype`'s candidate: :attr:`digest`, with what changes only some
        types' walk added for those types alone (a type whose walk did not change keeps its
        candidates): the superblock types whose bytes the walk writes itself
        (compensation_walk.writes), and the "packed" sweep's types rounded by the proxy."""
        q = qt.get(qtype)
        extra = ""
        if writes_bytes(self.sweep, q):
            extra += "|written-held/1" if _proxied(self.sweep, q) else "|written/1"
        if self.sweep == "packed" and _proxied(self.sweep, q):
            from . import proxy_rounding as pr

            extra += f"|proxy:{pr.settings()}"
        return hashlib.sha256(f"{self.digest}{extra}".encode()).hexdigest() if extra else self.digest


def revision(sweep: str) -> str | None:
    """What `sweep`'s walk does beyond the sweep's name, for a record of a file made with it
    (bench rows): the written bytes and the packed sweep's proxy types; None for neither (the
    walk as the sweep's name alone described it before)."""
    parts = []
    if sweep in ("ruled", "fixed", "packed") and walk.WRITE_CODES:
        parts.append("written/1")
    if any(writes_bytes(sweep, t) and _proxied(sweep, qt.get(t)) for t in walk.held_writes()):
        parts.append("held/1")
    if sweep == "packed" and walk.PACKED_PROXY:
        from . import proxy_rounding as pr

        parts.append(f"proxy={','.join(sorted(walk.PACKED_PROXY))}:{pr.VERSION}")
    return "|".join(parts) or None


def writes_bytes(sweep: str, qtype: str | qt.QType) -> bool:
    """Whether a compensated candidate of `qtype` under `sweep` is the walk's own bytes (no
    quantization of W' after the walk: compensation_walk.writes)."""
    q = qt.get(qtype)
    return sweep in ("ruled", "fixed", "packed", "proxy") and walk.writes(q, q.block, _proxied(sweep, q))


def _proxied(sweep: str, q: qt.QType) -> bool:
    """Whether the walk of `q` under `sweep` takes its rounding from the proxy (proxy_rounding.py)."""
    return sweep == "proxy" or (sweep == "packed" and q.name in walk.PACKED_PROXY)


def _drop_pages(a: np.ndarray) -> None:
    """Give back the pages a Hessian mapped from its file (hessian_store.load_hessians) holds in
    this process once it is read: the page cache keeps them and a later read maps them again,
    while a process that reads every Hessian of a model (9.8 GB for Qwen2.5-1.5B) would otherwise
    keep them all in its resident set to the end (measured: a 640 MB file's 40 Hessians, each
    checked and factored, left 728 MB of file pages resident with the libraries' and a 1,005 MB
    peak; 86 MB and 376 MB after this)."""
    import mmap

    mm = a.base if isinstance(a.base, mmap.mmap) else getattr(a, "_mmap", None)
    if isinstance(mm, mmap.mmap) and hasattr(mm, "madvise") and hasattr(mmap, "MADV_DONTNEED"):
        try:
            mm.madvise(mmap.MADV_DONTNEED)
        except (OSError, ValueError):  # closed, or a platform without it: the pages stay, nothing else changes
            pass


FACTOR_CACHE_BYTES = 512 << 20
_FACTORS: OrderedDict = OrderedDict()  # digest -> (factor, dead), least recently used first


def release_factors() -> None:
    """Drop the kept factors: a build of candidates in this process is over, and a training run
    would otherwise hold up to :data:`FACTOR_CACHE_BYTES` through its steps."""
    _FACTORS.clear()


def applies(qtype: str | qt.QType) -> bool:
    """Float types are written as they are; every quantized type is compensated."""
    return not qt.get(qtype).is_float


def _damped_cholesky(hessian: np.ndarray, damp: float, *, reversed_order: bool):
    """(L, dead): the lower Cholesky factor (float64) of H + λ·mean(diag H)·I, with the dead
    columns' (zero diagonal: never active on the calibration text) diagonal set to 1 first, of
    J H J (the order reversed) when `reversed_order`; L is None when no column is live. One float64
    copy of H at a time beside L."""
    import torch

    dead = np.diagonal(hessian) <= 0
    if bool(dead.all()):
        return None, dead
    src = hessian[::-1, ::-1] if reversed_order else hessian
    H = torch.from_numpy(np.array(src, dtype=np.float64, order="C"))  # a copy: the caller's H stays as it is
    live = torch.from_numpy(~(dead[::-1] if reversed_order else dead).copy())
    diag = torch.diagonal(H)
    diag[~live] = 1.0
    diag += damp * float(torch.mean(diag[live]))
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        raise QuantizationInputError("the damped Hessian is not positive definite; raise the damping")
    return L, dead


def _cholesky_factor(hessian: np.ndarray, damp: float):
    """U, the upper Cholesky factor of the damped H⁻¹, float64 (the "requant" sweep's)."""
    import torch

    L, dead = _damped_cholesky(hessian, damp, reversed_order=False)
    if L is None:
        return None, dead
    return torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True), dead


def _reversed_factor(hessian: np.ndarray, damp: float):
    """M, upper triangular with a positive diagonal and H = M Mᵀ (H damped), in float32 for the
    sweep: with J the order reversal and J H J = L Lᵀ, M = J L J. One Cholesky and nothing else:
    the Cholesky factor of H⁻¹ that GPTQ's update reads is M⁻¹, and the sweep
    (:func:`compensation_walk.sweep_fixed`) needs it only one group's diagonal block at a time.
    Computed in float64 on the calling thread, with two n × n float64 matrices at the peak (J H J, then L)."""
    import torch

    L, dead = _damped_cholesky(hessian, damp, reversed_order=True)
    if L is None:
        return None, dead
    return torch.flip(L.to(torch.float32), (0, 1)), dead


def compensated_matrix(matrix: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None,
                       comp: Compensation, lib=None, *, record: dict | None = None) -> np.ndarray:
    """W' for `matrix` (rows × n, float32, GGUF layout) in `qtype`: see the module docstring.
    Columns whose Hessian diagonal is zero (never active on the calibration text) are left as
    they are and pass no error on. With `record` (a dict; sweeps but "requant"), its
    ``"rounding"`` is set to the walk's rounding of every step (rows × n float32, NaN where a
    step was not rounded): what the walk assumed the file's values would be."""
    return compensated(matrix, qtype, imatrix, comp, lib, record=record)[0]


def compensated(matrix: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None,
                comp: Compensation, lib=None, *, record: dict | None = None) -> tuple[np.ndarray, bytes | None]:
    """(W', the candidate's bytes where the walk wrote them itself, else None):
    :func:`compensated_matrix`, with the bytes of compensation_walk.writes' types."""
    import torch

    q = qt.get(qtype)
    m = np.ascontiguousarray(matrix, dtype=np.float32)
    if m.ndim != 2:
        raise QuantizationInputError(f"compensation takes a 2-D matrix, got {m.shape}")
    rows, n = m.shape
    if comp.n != n:
        raise QuantizationInputError(f"Hessian is {comp.n} × {comp.n}, the matrix has {n} columns")
    if not applies(q) or rows == 0:
        return m, None
    lib = lib or ggml.lib()
    B = lib.block_size(q)
    if n % B:
        raise QuantizationInputError(f"{q.name} blocks of {B} do not tile rows of {n}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits on every run: export computes W' again
    try:
        U, dead = comp.factor()  # "requant": U; the other sweeps: M (_reversed_factor)
        if U is None:
            return m, None
        if comp.sweep != "requant":  # dead columns: no update reaches them, no error leaves them
            packed, ruled = {"packed": (walk.PACKED_SWEEP, walk.PACKED_RULED), "ruled": (frozenset(), walk.RULED_SWEEP),
                             "proxy": (frozenset(), walk.RULED_SWEEP)}.get(comp.sweep, (walk.PACKED, frozenset()))
            out, data = walk.sweep_fixed(m, q, imatrix, U, dead, lib, B, packed, ruled,
                                         proxy=_proxied(comp.sweep, q), record=record)
            return np.ascontiguousarray(out), data
        W = torch.from_numpy(m.astype(np.float64))
        live = torch.from_numpy(~dead)
        step = B if q.name in WHOLE_SUPERBLOCK else min(B, walk.STEP)
        for s0 in range(0, n - step, step):  # the last step has no later columns to pass its error to
            s1 = s0 + step
            b0 = (s0 // B) * B  # the block holding the step, quantized as it stands now
            blk = np.ascontiguousarray(W[:, b0:b0 + B].numpy(), dtype=np.float32)
            vec = None if imatrix is None else np.ascontiguousarray(imatrix[b0:b0 + B], dtype=np.float32)
            data = lib.quantize(blk, q, vec, name="compensation", workers=1)
            Q = torch.from_numpy(lib.dequantize(data, q, blk.shape, name="compensation")[:, s0 - b0:s1 - b0]
                                 .astype(np.float64))
            E = (W[:, s0:s1] - Q) * live[s0:s1]
            err = torch.linalg.solve_triangular(U[s0:s1, s0:s1], E, upper=True, left=False)
            W[:, s1:] -= err @ U[s0:s1, s1:]
        out = W.numpy().astype(np.float32)
    finally:
        torch.set_num_threads(threads)
    out[:, dead] = m[:, dead]
    return np.ascontiguousarray(out), None


def quantize_compensated(matrix: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None,
                         comp: Compensation | None, *, lib=None, name: str = "tensor", workers: int | None = 1) -> bytes:
    """The candidate's bytes: the walk's own where it writes them (compensation_walk.writes),
    else libggml-base's quantization of W' (of `matrix` itself when `comp` is None or the type is
    a float type)."""
    lib = lib or ggml.lib()
    if comp is not None and applies(qtype):
        matrix, data = compensated(matrix, qtype, imatrix, comp, lib)
        if data is not None:
            return data
    return lib.quantize(np.ascontiguousarray(matrix, dtype=np.float32), qtype, imatrix, name=name, workers=workers)


class QuantInputs(Mapping):
    """What the quantizer is given besides a tensor: as a Mapping, GGUF name → imatrix vector
    (what ``setup.imatrix_vectors`` returns); and HF tensor name → :class:`Compensation`."""

    def __init__(self, vectors: Mapping[str, np.ndarray] | None, compensation: Mapping[str, Compensation] | None = None):
        self._vectors = dict(vectors or {})
        self.compensation = dict(compensation or {})

    def __getitem__(self, key: str) -> np.ndarray:
        return self._vectors[key]

    def __iter__(self):
        return iter(self._vectors)

    def __len__(self) -> int:
        return len(self._vectors)

    def __bool__(self) -> bool:  # compensation without an imatrix is still something to pass on
        return bool(self._vectors) or bool(self.compensation)


def compensation_of(inputs, name: str) -> Compensation | None:
    """The compensation of tensor `name` in `inputs` (a :class:`QuantInputs`; None for a plain
    vector mapping)."""
    comp = getattr(inputs, "compensation", None)
    return comp.get(name) if comp else None


def compensations(hessians: Mapping[str, np.ndarray], damp: float, sweep: str = DEFAULT_SWEEP) -> dict[str, Compensation]:
    return {k: Compensation(v, float(damp), sweep) for k, v in hessians.items()}  # shared arrays stay shared
