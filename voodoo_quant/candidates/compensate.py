"""Error compensation: the weights handed to llama.cpp's quantizer, adjusted so that each block's
rounding error is absorbed by the columns not yet quantized (GPTQ's update, with libggml-base's
own quantizer as the rounding oracle).

A candidate stays what the product's contract says it is: the bytes libggml-base's
``ggml_quantize_chunk`` writes for a float32 matrix, with the run's imatrix vector. With
compensation that matrix is not the checkpoint's weight W but W', built block by block along the
row (columns in GGUF order):

    for each step of columns (see below):
        Q   = to_float(quantize(W'[:, the block holding the step]))[:, step]   # the quantizer's rounding
        E   = (W'[:, step] − Q) · U[step, step]⁻¹
        W'[:, later] −= E · U[step, later]

where U is the upper Cholesky factor of (H + λ·mean(diag H)·I)⁻¹ and H = Σ xᵀx over the layer's
inputs on calibration text (the fixed and packed sweeps hold M = U⁻¹, from one Cholesky of H, and
read U a group's diagonal block at a time: :func:`_sweep_fixed`). This minimizes ‖(W − Ŵ) X‖² one block at a time (Frantar et al.,
GPTQ, with a ggml block's columns fixed at once because they share a scale). A step is a block of
32, or one 32-column sub-block of a 256-weight superblock. How the step's rounding Q is obtained
is the sweep (:attr:`Compensation.sweep`):

- ``"ruled"`` (:func:`_sweep_fixed`): a 32-block is quantized by libggml-base as the
  walk reaches it. A superblock of :data:`fixed_rounding.SWEEP_TYPES` (K-quants, IQ4_XS) is
  quantized once, when the walk reaches it; its later steps are rounded in torch with that
  quantization's scales held fixed, and W' holds the rounded values (values its scales represent,
  which libggml-base quantizes back to nearly themselves, so the error passed on is the file's).
  A grid IQ superblock (IQ1–IQ3, :data:`RULED_SWEEP`) is quantized once when the walk reaches it
  (its first step's rounding); each later step's grid points come from libggml-base on a probe
  holding the step's columns of 8 rows side by side as one superblock, each position weighted as
  its own row's superblock weighs it, and the step's scale is coded against the row superblock's
  largest (grid_probe.py: a grid superblock's sub-block picks its points from its own values and
  the superblock's σ², and its scale from the superblock's largest). W' holds the updated weights.
  Measured on the 1.5B benchmark model's tensors: 1.001–1.007× the layer error of ``"fixed"``
  per type (0.998–1.013× per tensor) at 4.1–5.2× a plain candidate's time against 9.6–10.0×
  (docs/lab/2026-12-06-ruled-probe.md).
- ``"fixed"``: as ``"ruled"``, but a grid IQ superblock is quantized again at every step, a
  libggml-base call on the whole superblock for each of its 8 steps (measured with a fixed-scale
  oracle instead: 8–36 % more layer error; requantizing every 2nd–8th step only, 8–37 %).
- ``"packed"`` (the default): as ``"ruled"``, but each step of a grid IQ type of
  :data:`PACKED_SWEEP` (IQ3_S, IQ2_S, IQ2_XXS, IQ1_S) is rounded by the probe with the imatrix
  slice repeated (the probe's σ²) and the probe's own scale ruler; the other ruled grid types
  (:data:`PACKED_RULED`) are walked as under ``"ruled"``. 2.4–3.0× a plain candidate, and 4–75 %
  more layer error than ``"fixed"`` on real tensors (the probe's rounding is as good as the
  file's but not the file's); but the files' KLD on the 1.5B benchmark model is the same as the
  ruled walk's within noise at two sizes and two eval texts, at 0.38× its train step
  (docs/lab/2026-12-07-the-walk-in-files.md), so it is the default. :data:`PACKED` walks named
  types so under ``"fixed"`` (a measured variant). float32, updates applied a group at a time; the factor from one Cholesky
  of the order-reversed H (``bench/compensation_cost.py``, ``bench/compensation_objective.py``).
- ``"proxy"`` (:func:`_sweep_fixed` with `proxy`): as ``"ruled"``, but a step of a type of
  :data:`proxy_rounding.TYPES` is rounded in torch by a model of the type's quantizer, so the
  walk makes no libggml-base call for it (proxy_rounding.py): Q8_0 by its reference rounding
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

The final bytes are the quantizer's for the whole rows of W', so training, bake and export all see
the same bytes. :func:`compensated_matrix` is deterministic (one thread); export reads the
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
from . import grid_probe

ALGORITHM = "gptq-blocks/2"  # the "requant" sweep; /2: whole-superblock steps for WHOLE_SUPERBLOCK (Q5_K)
FIXED_ALGORITHM = "gptq-fixed/2"  # the "ruled", "fixed" and "packed" sweeps (:func:`_sweep_fixed`; the digest adds which)
SWEEPS = ("ruled", "fixed", "packed", "requant", "proxy")
DEFAULT_SWEEP = "packed"
DEFAULT_DAMP = 0.1
LAZY = 128  # columns of a 32-block type updated together before the rest of the row (one GEMM)
STEP = 32  # columns fixed per step: a block, or a 256-superblock's sub-block (its scale's span)
# superblock types compensated one whole superblock per step (module docstring: measured)
WHOLE_SUPERBLOCK = frozenset({"Q5_K"})
# the "fixed" sweep's grid IQ superblocks (fixed_rounding.supports, not SWEEP_TYPES): quantized by
# libggml-base again at the 32-column steps GRID_STEPS names (index within the superblock; None: all),
# the steps between rounded with the last quantization's scales (W' keeps the updated weights);
# GRID_HOLD: W' holds those rounded values. Measured variants (bench/compensation_cost.py)
GRID_STEPS: frozenset | None = None
GRID_HOLD = False
# a grid superblock walked GRID_PASSES times (0: per step, as above): each pass takes, for every
# step, the values libggml-base gave the superblock the previous pass left (the first: as the walk
# reached it), or with GRID_PASS_ROUND those values' scales and the torch rounding
GRID_PASSES = 0
GRID_PASS_ROUND = False
# the grid types whose step is rounded from a probe (:func:`grid_probe.probe_rounding`): the step's 32 columns
# of 8 rows side by side as one 256-wide row (the imatrix slice repeated), quantized by libggml-base
# (rows × 32 weights a step, not rows × 256). Measured (docs/lab/2026-12-05-grid-compensation.md):
# IQ2_XXS 1.008-1.021x the per-step walk's layer objective at 2.0-2.5x a plain candidate's cost
# (per step: 9.0-9.8x); IQ2_S 1.016-1.035x, IQ1_S 1.007-1.029x, IQ3_S 1.05-1.07x. None by default
# until the files' KLD on the benchmark says the ~1-2 % of layer error costs nothing.
PACKED: frozenset = frozenset()
# the "packed" sweep: the "fixed" sweep with every grid IQ type's step rounded from the probe. On
# the 1.5B benchmark model's own tensors (docs/lab/2026-12-06-compensation-on-real-tensors.md) it
# left 1.07x (IQ2_XXS) to 1.25x (IQ3_S) the per-step walk's layer error at 2.7x plain per menu
# (fixed: 8.8x): the probe's rounding is as good as the file's but not the file's (a sub-block's
# scale is coded against another ruler), so the walk passes on an error the file does not have
PACKED_SWEEP = frozenset({"IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S"})
# the "ruled" sweep's: the grid IQ types whose ruler is max s / DIV (grid_probe.RULES, checked
# against libggml-base). IQ1_M refits its ruler over the whole superblock after coding the scales
# (a third stage the ruler does not follow: 1.0465x the per-step walk's error measured on a
# down_proj), so it is walked per step
RULED_SWEEP = frozenset(grid_probe.RULES) - {"IQ1_M"}
# the "packed" sweep's other grid types (IQ2_XS, IQ3_XXS: the probe's own ruler is not measured on
# them): walked as under "ruled", so no grid type but IQ1_M is quantized again at every step
PACKED_RULED = RULED_SWEEP - PACKED_SWEEP
PACK_NORM = "rms"  # a probe row's norm: its superblock's RMS ("max": its largest 32-column RMS; measured)
# the weights a probe's search uses (grid_probe.py): "probe", the imatrix slice repeated (the
# probe superblock's σ², not the row's); "row", each position weighted as its row's own superblock
# would weigh it, so the probe's grid choice is the row's
PACK_WEIGHTS = "probe"  # one of grid_probe.WEIGHT_MODES


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
                algo += f"|packed={','.join(sorted(PACKED_SWEEP))}:{PACK_NORM}|ruled={','.join(sorted(PACKED_RULED))}"
            if self.sweep in ("ruled", "proxy"):
                algo += f"|ruled={','.join(sorted(RULED_SWEEP))}:{PACK_NORM}"
            if self.sweep == "proxy":
                from . import proxy_rounding as pr

                algo += f"|{pr.settings()}"
            elif (self.sweep == "packed" or PACKED) and PACK_WEIGHTS != "probe":
                algo += f"|weights={PACK_WEIGHTS}"
            if self.sweep != "requant" and (PACKED or GRID_STEPS is not None or GRID_HOLD or GRID_PASSES):
                # a measured variant of the walk (bench/compensation_cost.py): never the default's entries
                algo += f"|pack={','.join(sorted(PACKED))}:{PACK_NORM}|steps={sorted(GRID_STEPS or ())}" \
                        f"|hold={GRID_HOLD}|passes={GRID_PASSES}:{GRID_PASS_ROUND}"
            h = hashlib.sha256(f"{algo}|{float(self.damp)!r}".encode())
            h.update(struct.pack("<q", self.n))
            h.update(memoryview(np.ascontiguousarray(self.hessian, dtype="<f4")).cast("B"))
            _drop_pages(self.hessian)
            self._digest.append(h.hexdigest())
        return self._digest[0]


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
    (:func:`_sweep_fixed`) needs it only one group's diagonal block at a time. Computed in
    float64 on the calling thread, with two n × n float64 matrices at the peak (J H J, then L)."""
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
    import torch

    q = qt.get(qtype)
    m = np.ascontiguousarray(matrix, dtype=np.float32)
    if m.ndim != 2:
        raise QuantizationInputError(f"compensation takes a 2-D matrix, got {m.shape}")
    rows, n = m.shape
    if comp.n != n:
        raise QuantizationInputError(f"Hessian is {comp.n} × {comp.n}, the matrix has {n} columns")
    if not applies(q) or rows == 0:
        return m
    lib = lib or ggml.lib()
    B = lib.block_size(q)
    if n % B:
        raise QuantizationInputError(f"{q.name} blocks of {B} do not tile rows of {n}")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same bits on every run: export computes W' again
    try:
        U, dead = comp.factor()  # "requant": U; the other sweeps: M (_reversed_factor)
        if U is None:
            return m
        if comp.sweep != "requant":  # dead columns: no update reaches them, no error leaves them
            packed, ruled = {"packed": (PACKED_SWEEP, PACKED_RULED), "ruled": (frozenset(), RULED_SWEEP),
                             "proxy": (frozenset(), RULED_SWEEP)}.get(comp.sweep, (PACKED, frozenset()))
            return np.ascontiguousarray(_sweep_fixed(m, q, imatrix, U, dead, lib, B, packed, ruled,
                                                     proxy=comp.sweep == "proxy", record=record))
        W = torch.from_numpy(m.astype(np.float64))
        live = torch.from_numpy(~dead)
        step = B if q.name in WHOLE_SUPERBLOCK else min(B, STEP)
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
    return np.ascontiguousarray(out)


def _sweep_fixed(m: np.ndarray, q: qt.QType, imatrix, M, dead, lib, B: int,
                 packed: frozenset = frozenset(), ruled: frozenset = frozenset(), *, proxy: bool = False,
                 record: dict | None = None) -> np.ndarray:
    """The "ruled", "fixed" and "packed" sweeps, in float32: W' for `m` with the error of every 32
    columns passed on.

    A superblock type of :data:`fixed_rounding.SWEEP_TYPES` (the K-quants, IQ4_XS) is quantized
    by libggml-base once per superblock, when the walk reaches it; its first 32-column step takes
    libggml's values, each later step is rounded with that quantization's scales held fixed
    (fixed_rounding.py), and W' holds the rounded values: a superblock of values the quantizer's
    scales represent exactly, which libggml-base quantizes back to (nearly) the same values, so
    the error passed on is the file's. A step of a `packed` or `ruled` type is rounded by
    libggml-base on a probe of 8 rows' step columns (:func:`grid_probe.probe_rounding`); for a
    `ruled` type, each of its superblocks is quantized when the walk reaches it (the first step's
    rounding) and the later steps' scales are coded against that superblock's ruler
    (:class:`grid_probe.SuperblockRuler`). Any other type (its block of 32, or a grid IQ
    superblock) is quantized by libggml-base at every step, as the "requant" sweep does; for
    these and the packed types W' holds the updated weights, and the row's last step (no later
    column to take its error) is not quantized.

    The walk goes a group at a time (the superblock, or :data:`LAZY` columns of 32-blocks), from
    M, the upper factor of H = M Mᵀ (:func:`_reversed_factor`). With the columns before a group G
    fixed (Q their rounding), the best values of the columns still free are
    W + (W − Q)_before · M[before, free] · M[free, free]⁻¹ (minimizing the error tr(ΔW H ΔWᵀ)
    over them; H's blocks in M's terms), and a leading block of an upper triangular inverse is the
    inverse of the leading block, so G starts from W_G + C_G · M_GG⁻¹, where C_G accumulates
    (W − Q)_S · M[S, G] over the groups S already walked (one product per group). Within G the
    steps are GPTQ's with U_GG = M_GG⁻¹, the diagonal block of the Cholesky factor of H⁻¹
    (Frantar et al.): no n × n inverse is formed (the LDLQ form of the same update, Chee et al.,
    QuIP). The GRID_* settings are the measured variants the product does not use
    (bench/compensation_cost.py sets them). With `proxy`, the types of
    :data:`proxy_rounding.TYPES` are rounded by proxy_rounding.py instead of libggml-base: a
    32-block by :func:`proxy_rounding.round_q8_0`, a K-quant superblock's steps at the scales of
    :class:`proxy_rounding.KQuantScales` (held, as "fixed" holds libggml's), a grid superblock's
    by :func:`proxy_rounding.grid_proxy`'s (held where :func:`proxy_rounding.holds`)."""
    import torch

    from . import fixed_rounding  # lazy: it imports torch, which building plain candidates never needs
    from . import proxy_rounding

    rows, n = m.shape
    W0 = torch.from_numpy(m)  # read only: the weights as given
    out = torch.zeros(rows, n, dtype=torch.float32)  # C for the groups not yet walked, W' for the others
    live = torch.from_numpy(~dead).to(torch.float32)
    vec = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    step = min(B, STEP)
    group = B if B > STEP else max(B, LAZY)
    fixed = B > STEP and q.name in fixed_rounding.SWEEP_TYPES
    grid = B > STEP and not fixed and fixed_rounding.supports(q)
    steps = GRID_STEPS if grid and GRID_STEPS is not None else None
    hold = fixed or (steps is not None and GRID_HOLD)
    passes = int(GRID_PASSES) if grid else 0
    ruled = grid and q.name in ruled  # each in grid_probe.RULES
    pack = ruled or (grid and q.name in packed)
    ruler = None
    proxy = proxy and proxy_rounding.supports(q) and not passes and steps is None
    if proxy and (B == STEP) != (q.name == "Q8_0") or proxy and B > STEP and not (fixed or grid):
        raise QuantizationInputError(f"the proxy sweep has no superblock walk for {q.name}")
    vt = proxy_rounding.as_vector(vec, W0.device) if proxy else None
    held = proxy and grid and proxy_rounding.holds(q)  # W' holds values libggml gives back
    hold = hold or held
    rec = None
    if record is not None:
        rec = torch.full((rows, n), float("nan"), dtype=torch.float32)
        record["rounding"] = rec.numpy()
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        Ug = torch.linalg.solve_triangular(M[g0:g1, g0:g1].double(), torch.eye(g1 - g0, dtype=torch.float64),
                                           upper=True).to(torch.float32)  # U_GG = M_GG⁻¹
        W = W0[:, g0:g1] + out[:, g0:g1] @ Ug if g0 else W0[:, g0:g1].clone()  # the group's columns, local
        vg = None if vec is None else vec[g0:g1]
        if passes:
            W, Q = _superblock_passes(W, q, vg, Ug, live[g0:g1], lib, passes, bool(GRID_PASS_ROUND))
        else:
            Q = torch.zeros(rows, g1 - g0, dtype=torch.float32)
            scales = None
            for c0 in range(0, g1 - g0, step):
                c1 = c0 + step
                if g0 + c1 == n and not hold:  # the row's last step: its error has no column to go to
                    break
                b0 = (c0 // B) * B  # the block holding the step, local
                if proxy and B == STEP:  # a 32-block: its step is the block
                    Qs = proxy_rounding.round_q8_0(W[:, c0:c1])
                elif proxy and fixed:
                    if c0 == b0:
                        scales = proxy_rounding.KQuantScales(W[:, b0:b0 + B], q, None if vt is None else vt[g0 + b0:g0 + b0 + B])
                    Qs = scales.round(W[:, c0:c1], c0 - b0, c1 - b0)
                elif proxy:
                    if c0 == b0:
                        ruler = proxy_rounding.grid_proxy(W[:, b0:b0 + B], q, None if vt is None else vt[g0 + b0:g0 + b0 + B])
                    Qs = ruler.round(c0 - b0, W[:, b0:b0 + B])
                elif scales is not None and (fixed or (c0 - b0) // step not in steps):
                    Qs = scales.round(W[:, c0:c1], c0 - b0, c1 - b0)
                elif pack and ruled and c0 == b0:  # the walk reaches the superblock: quantized as it stands
                    ruler = grid_probe.SuperblockRuler(W[:, b0:b0 + B], q, None if vg is None else vg[b0:b0 + B], lib)
                    Qs = ruler.first[:, :step]
                elif pack:
                    sq = W[:, b0:b0 + B].square()
                    norm = (sq.mean(1, keepdim=True) if PACK_NORM == "rms" else
                            sq.reshape(rows, -1, step).mean(2).amax(1, keepdim=True)).sqrt()
                    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
                    v = None if vg is None else vg[c0:c1]
                    ms = sq.mean(1) / norm.squeeze(1).square()  # the row's superblock's mean square, normalized
                    if ruled:
                        vals, code = grid_probe.probe_rounding(W[:, c0:c1] / norm, q, v, lib, B, ms, "row", codes=True)
                        Qs = ruler.round(c0 - b0, W[:, b0:b0 + B], code, vals * norm)
                    else:
                        Qs = grid_probe.probe_rounding(W[:, c0:c1] / norm, q, v, lib, B, ms, PACK_WEIGHTS) * norm
                else:
                    blk = np.ascontiguousarray(W[:, b0:b0 + B].numpy())
                    v = None if vg is None else vg[b0:b0 + B]
                    data = lib.quantize(blk, q, v, name="compensation", workers=1)
                    Qs = torch.from_numpy(lib.dequantize(data, q, blk.shape, name="compensation")[:, c0 - b0:c1 - b0])
                    if fixed or steps is not None:
                        scales = fixed_rounding.FixedScales(data, q, rows, B, v)
                E = (W[:, c0:c1] - Qs) * live[g0 + c0:g0 + c1]
                err = torch.linalg.solve_triangular(Ug[c0:c1, c0:c1], E, upper=True, left=False)
                if hold:
                    W[:, c0:c1] = ruler.held if held else Qs
                W[:, c1:] -= err @ Ug[c0:c1, c1:]
                Q[:, c0:c1] = Qs
                if rec is not None:
                    rec[:, g0 + c0:g0 + c1] = Qs
        out[:, g0:g1] = W
        if g1 < n:
            out[:, g1:] += ((W0[:, g0:g1] - Q) * live[g0:g1]) @ M[g0:g1, g1:]
    return out.numpy()


def _superblock_passes(start, q: qt.QType, v, U, live, lib, passes: int, rnd: bool):
    """Walk a grid superblock `passes` times from `start` (rows × its width: the values it has
    when the walk reaches it), each pass's rounding taken from libggml-base's quantization of
    what the previous pass left; U is the group's block of the Cholesky factor of H⁻¹ and `live`
    its columns' mask. Returns the last pass's weights and rounding."""
    import torch

    from . import fixed_rounding  # lazy: it imports torch, which building plain candidates never needs

    rows, width = start.shape
    sb = start
    for _ in range(passes):
        blk = np.ascontiguousarray(sb.numpy())
        data = lib.quantize(blk, q, v, name="compensation", workers=1)
        D = None if rnd else torch.from_numpy(lib.dequantize(data, q, blk.shape, name="compensation"))
        scales = fixed_rounding.FixedScales(data, q, rows, width, v) if rnd else None
        sb = start.clone()
        Q = torch.empty(rows, width, dtype=torch.float32)
        for c0 in range(0, width, STEP):
            c1 = c0 + STEP
            Q[:, c0:c1] = scales.round(sb[:, c0:c1], c0, c1) if rnd else D[:, c0:c1]
            E = (sb[:, c0:c1] - Q[:, c0:c1]) * live[c0:c1]
            err = torch.linalg.solve_triangular(U[c0:c1, c0:c1], E, upper=True, left=False)
            sb[:, c1:] -= err @ U[c0:c1, c1:]
    return sb, Q


def quantize_compensated(matrix: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None,
                         comp: Compensation | None, *, lib=None, name: str = "tensor", workers: int | None = 1) -> bytes:
    """The candidate's bytes: libggml-base's quantization of W' (of `matrix` itself when `comp`
    is None or the type is a float type)."""
    lib = lib or ggml.lib()
    if comp is not None and applies(qtype):
        matrix = compensated_matrix(matrix, qtype, imatrix, comp, lib)
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
