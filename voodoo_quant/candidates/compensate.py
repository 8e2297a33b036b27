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
inputs on calibration text. This minimizes ‖(W − Ŵ) X‖² one block at a time (Frantar et al.,
GPTQ, with a ggml block's columns fixed at once because they share a scale). A step is a block of
32, or one 32-column sub-block of a 256-weight superblock, which is quantized again after each of
its sub-blocks from the updated values; except for the types of :data:`WHOLE_SUPERBLOCK`, whose
superblock is one step. Their sub-block scales and minimums are coded against the superblock's
largest, so quantizing the superblock again moves the sub-blocks already fixed, and the error
passed on is no longer the file's. Measured on SmolLM2-135M's ffn_down (576 × 1536, layers 3, 15
and 27; ‖(W − Ŵ)X‖² relative, from the calibration Hessians; ``bench/compensation_step.py``): a
whole-superblock step gives 0.69–0.72× the error of 32-column steps for Q5_K, in one quantizer
call per superblock instead of eight (0.90–0.98× on the synthetic problem of the tests). Q4_K
(0.90–0.92×) and Q2_K (0.94–0.95×) gain on SmolLM2 too but lose 6–12 % on the synthetic problem,
so they keep 32-column steps with Q6_K (1.09–1.11×), Q3_K (1.11–1.14×) and every IQ type
(1.07–1.17×). The final bytes are the quantizer's for the whole rows of W', so training, bake and export all see
the same bytes; :func:`compensated_matrix` is deterministic (float64 on one thread), and export
computes it again from the same inputs.
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

ALGORITHM = "gptq-blocks/2"  # /2: whole-superblock steps for WHOLE_SUPERBLOCK (Q5_K)
DEFAULT_DAMP = 0.1
STEP = 32  # columns fixed per step: a block, or a 256-superblock's sub-block (its scale's span)
# superblock types compensated one whole superblock per step (module docstring: measured)
WHOLE_SUPERBLOCK = frozenset({"Q5_K"})


@dataclass(frozen=True)
class Compensation:
    """The inputs of one tensor's compensation: its layer input's Hessian (GGUF column order,
    float32, n × n) and the damping fraction. Its :attr:`digest` keys the candidate cache."""

    hessian: np.ndarray
    damp: float = DEFAULT_DAMP
    _digest: list = field(default_factory=list, repr=False, compare=False)

    def __post_init__(self) -> None:
        h = self.hessian
        if h.ndim != 2 or h.shape[0] != h.shape[1] or h.dtype != np.float32:
            raise QuantizationInputError(f"a Hessian is a square float32 matrix, got {h.dtype} {h.shape}")
        if not (0.0 < float(self.damp) < 1e3):
            raise QuantizationInputError(f"damping fraction must be > 0, got {self.damp}")
        if not np.all(np.isfinite(h)):
            raise QuantizationInputError("the Hessian holds NaN or Inf")

    @property
    def n(self) -> int:
        return int(self.hessian.shape[0])

    def factor(self):
        """(U, dead): the upper Cholesky factor of the damped inverse Hessian (None when no
        column is live) and the mask of dead columns. A process keeps the last few it computed
        (:data:`FACTOR_CACHE_BYTES` in all): a tensor's types are built one after another and
        share it, while the factors of a whole model (n² float64 each) are never held."""
        key = self.digest
        hit = _FACTORS.get(key)
        if hit is not None:
            _FACTORS.move_to_end(key)
            return hit
        f = _cholesky_factor(self.hessian, float(self.damp))
        size = 8 * self.n * self.n
        if size <= FACTOR_CACHE_BYTES:
            _FACTORS[key] = f
            while sum(8 * u.shape[0] ** 2 for u, _ in _FACTORS.values() if u is not None) > FACTOR_CACHE_BYTES:
                _FACTORS.popitem(last=False)
        return f

    @property
    def digest(self) -> str:
        """sha256 of the algorithm (with the types it walks a whole superblock at a time), the
        damping and the Hessian's bytes (computed once): a changed walk never reads old candidates."""
        if not self._digest:
            h = hashlib.sha256(f"{ALGORITHM}|{','.join(sorted(WHOLE_SUPERBLOCK))}|{float(self.damp)!r}".encode())
            h.update(struct.pack("<q", self.n))
            h.update(memoryview(np.ascontiguousarray(self.hessian, dtype="<f4")).cast("B"))
            self._digest.append(h.hexdigest())
        return self._digest[0]


FACTOR_CACHE_BYTES = 512 << 20
_FACTORS: OrderedDict = OrderedDict()  # digest -> (U, dead), least recently used first


def release_factors() -> None:
    """Drop the kept factors: a build of candidates in this process is over, and a training run
    would otherwise hold up to :data:`FACTOR_CACHE_BYTES` through its steps."""
    _FACTORS.clear()


def applies(qtype: str | qt.QType) -> bool:
    """Float types are written as they are; every quantized type is compensated."""
    return not qt.get(qtype).is_float


def _cholesky_factor(hessian: np.ndarray, damp: float):
    import torch

    H = torch.from_numpy(hessian.astype(np.float64))
    diag = torch.diagonal(H)
    dead = diag <= 0
    if bool(dead.all()):
        return None, dead.numpy()
    H[dead, dead] = 1.0
    mean = float(torch.mean(torch.diagonal(H)[~dead]))
    H += (damp * mean) * torch.eye(H.shape[0], dtype=torch.float64)
    L, info = torch.linalg.cholesky_ex(H)
    if int(info) != 0:
        raise QuantizationInputError("the damped Hessian is not positive definite; raise the damping")
    U = torch.linalg.cholesky(torch.cholesky_inverse(L), upper=True)
    return U, dead.numpy()


def compensated_matrix(matrix: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None,
                       comp: Compensation, lib=None) -> np.ndarray:
    """W' for `matrix` (rows × n, float32, GGUF layout) in `qtype`: see the module docstring.
    Columns whose Hessian diagonal is zero (never active on the calibration text) are left as
    they are and pass no error on."""
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
        U, dead = comp.factor()
        if U is None:
            return m
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


def compensations(hessians: Mapping[str, np.ndarray], damp: float) -> dict[str, Compensation]:
    return {k: Compensation(v, float(damp)) for k, v in hessians.items()}  # shared arrays stay shared
