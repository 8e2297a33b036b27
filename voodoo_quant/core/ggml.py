"""llama.cpp-exact quantization: a cffi (ABI mode) bridge to libggml-base.

The same C quantizer that ``llama-quantize`` calls produces every candidate, the bake and the
export, so the bytes the runtime serves are the bytes the gates were trained on.

At a Release build ggml checks nothing: a row length that is not a multiple of the block makes
K-quants write garbage and IQ types ``abort()`` the process; a NULL imatrix for IQ2_XXS/IQ2_XS/
IQ1_S aborts too. Every public function here validates its input first and raises
:class:`QuantizationInputError` naming the tensor, the type and the sizes.
"""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np

from . import envs, paths
from . import qtypes as qt
from .errors import GGMLLibraryError, QuantizationInputError

# Declarations copied in meaning from ggml/include/ggml.h at the pinned commit; the layout of
# ggml_type_traits is checked against the type table in tests (a wrong layout shows up at once).
_CDEF = """
typedef void (*ggml_to_float_t)(const void * x, float * y, int64_t k);
typedef void (*ggml_from_float_t)(const float * x, void * y, int64_t k);
struct ggml_type_traits {
    const char * type_name;
    int64_t blck_size;
    int64_t blck_size_interleave;
    size_t type_size;
    bool is_quantized;
    ggml_to_float_t to_float;
    ggml_from_float_t from_float_ref;
};
const struct ggml_type_traits * ggml_get_type_traits(int type);
const char * ggml_version(void);
const char * ggml_commit(void);
int64_t ggml_blck_size(int type);
size_t ggml_type_size(int type);
size_t ggml_row_size(int type, int64_t ne);
bool ggml_quantize_requires_imatrix(int type);
void ggml_quantize_init(int type);
size_t ggml_quantize_chunk(int type, const float * src, void * dst, int64_t start,
                           int64_t nrows, int64_t n_per_row, const float * imatrix);
bool ggml_validate_row_data(int type, const void * data, size_t nbytes);
"""

# Rows per work item when quantizing in parallel; small enough to balance, large enough that
# the per-call overhead is noise.
_MIN_ROWS_PER_TASK = 16


@dataclass(frozen=True)
class TypeTraits:
    name: str
    block: int
    type_size: int
    is_quantized: bool


class GGML:
    """A loaded libggml-base. Obtain one with :func:`lib`."""

    def __init__(self, path: Path):
        import cffi

        self.path = Path(path)
        self._ffi = cffi.FFI()
        self._ffi.cdef(_CDEF)
        # GGML_NO_BACKTRACE: a failing ggml check must not launch gdb on the user's process.
        os.environ.setdefault("GGML_NO_BACKTRACE", "1")
        try:
            self._c = self._ffi.dlopen(str(self.path))
        except OSError as e:
            raise GGMLLibraryError(f"cannot load libggml-base from {self.path}: {e}") from None
        self._init_lock = threading.Lock()
        self._initialized: set[int] = set()

    # -- library identity -------------------------------------------------------------------
    @property
    def version(self) -> str:
        return self._ffi.string(self._c.ggml_version()).decode()

    @property
    def commit(self) -> str:
        return self._ffi.string(self._c.ggml_commit()).decode()

    def traits(self, qtype: str | qt.QType) -> TypeTraits:
        q = qt.get(qtype)
        t = self._c.ggml_get_type_traits(q.id)
        return TypeTraits(
            name=self._ffi.string(t.type_name).decode(),
            block=int(t.blck_size),
            type_size=int(t.type_size),
            is_quantized=bool(t.is_quantized),
        )

    def row_size(self, qtype: str | qt.QType, n_per_row: int) -> int:
        q = qt.get(qtype)
        _check_row(q, n_per_row, "row_size")
        return int(self._c.ggml_row_size(q.id, n_per_row))

    def block_size(self, qtype: str | qt.QType) -> int:
        return int(self._c.ggml_blck_size(qt.get(qtype).id))

    def requires_imatrix(self, qtype: str | qt.QType) -> bool:
        return bool(self._c.ggml_quantize_requires_imatrix(qt.get(qtype).id))

    # -- quantize ---------------------------------------------------------------------------
    def quantize(
        self,
        weights: np.ndarray,
        qtype: str | qt.QType,
        imatrix: np.ndarray | None = None,
        *,
        name: str = "tensor",
        workers: int | None = None,
    ) -> bytes:
        """Quantize a 2-D float32 matrix (rows × n_per_row) exactly as llama-quantize does.

        `imatrix` is one float per column (n_per_row values), as llama-quantize passes it.
        Rows are split over `workers` threads (default ``VOODOO_QUANT_WORKERS``); cffi releases
        the GIL during the call and the output is byte-identical to one thread.
        """
        q = qt.get(qtype)
        w = _validate_weights(weights, q, name)
        rows, n_per_row = w.shape
        imat = _validate_imatrix(imatrix, q, n_per_row, name)
        if q.name == "F32":
            return w.tobytes()
        row_bytes = q.row_bytes(n_per_row)
        out = bytearray(rows * row_bytes)
        if rows == 0:
            return bytes(out)
        self._ensure_init(q)
        ffi = self._ffi
        src = ffi.from_buffer("float[]", w)
        dst = ffi.from_buffer(out)
        imp = ffi.NULL if imat is None else ffi.from_buffer("float[]", imat)

        def run(r0: int, r1: int) -> None:
            written = self._c.ggml_quantize_chunk(q.id, src, dst, r0 * n_per_row, r1 - r0, n_per_row, imp)
            if written != (r1 - r0) * row_bytes:
                raise GGMLLibraryError(
                    f"{name}: ggml_quantize_chunk wrote {written} bytes for rows {r0}:{r1} "
                    f"of {q.name}, expected {(r1 - r0) * row_bytes}"
                )

        n_workers = workers if workers is not None else envs.quant_workers()
        spans = _row_spans(rows, n_workers)
        if len(spans) == 1:
            run(*spans[0])
        else:
            with ThreadPoolExecutor(max_workers=len(spans)) as pool:
                for f in [pool.submit(run, a, b) for a, b in spans]:
                    f.result()
        return bytes(out)

    def _ensure_init(self, q: qt.QType) -> None:
        # ggml_quantize_chunk initializes IQ grids itself (thread-safe), but doing it once up
        # front keeps the seconds it takes out of the parallel section.
        if q.id in self._initialized:
            return
        with self._init_lock:
            if q.id not in self._initialized:
                self._c.ggml_quantize_init(q.id)
                self._initialized.add(q.id)

    # -- dequantize -------------------------------------------------------------------------
    def dequantize(self, data: bytes | bytearray | memoryview | np.ndarray, qtype: str | qt.QType,
                   shape: tuple[int, ...], *, name: str = "tensor") -> np.ndarray:
        """ggml ``to_float`` of `data` holding a tensor of `shape` (last dim = row length)."""
        q = qt.get(qtype)
        shape = tuple(int(s) for s in shape)
        if not shape or any(s < 0 for s in shape):
            raise QuantizationInputError(f"{name}: invalid shape {shape}")
        n_per_row = shape[-1]
        _check_row(q, n_per_row, name)
        expected = qt.tensor_bytes(q, shape)
        buf = np.frombuffer(data, dtype=np.uint8) if not isinstance(data, np.ndarray) else data.view(np.uint8).reshape(-1)
        if buf.size != expected:
            raise QuantizationInputError(
                f"{name}: {buf.size} bytes given for a {q.name} tensor of shape {shape}, expected {expected}"
            )
        n = int(np.prod(shape, dtype=np.int64))
        if q.name == "F32":
            return buf.view(np.float32).reshape(shape).copy()
        out = np.empty(n, dtype=np.float32)
        if n == 0:
            return out.reshape(shape)
        buf = np.ascontiguousarray(buf)
        traits = self._c.ggml_get_type_traits(q.id)
        if traits.to_float == self._ffi.NULL:
            raise GGMLLibraryError(f"libggml-base has no to_float for {q.name}")
        traits.to_float(self._ffi.from_buffer(buf), self._ffi.from_buffer("float[]", out), n)
        return out.reshape(shape)

    def validate_bytes(self, data: bytes, qtype: str | qt.QType) -> bool:
        """ggml_validate_row_data: False for NaN/Inf scales etc. (used on bytes read from files)."""
        q = qt.get(qtype)
        if len(data) % q.type_size:
            return False
        return bool(self._c.ggml_validate_row_data(q.id, self._ffi.from_buffer(data), len(data)))


def _row_spans(rows: int, workers: int) -> list[tuple[int, int]]:
    n = max(1, min(workers, rows // _MIN_ROWS_PER_TASK or 1))
    step = -(-rows // n)
    return [(a, min(rows, a + step)) for a in range(0, rows, step)]


def _check_row(q: qt.QType, n_per_row: int, name: str) -> None:
    if n_per_row <= 0 or n_per_row % q.block:
        raise QuantizationInputError(
            f"{name}: row size ({n_per_row}) is not a multiple of {q.name} block size ({q.block})"
        )


def _validate_weights(weights: np.ndarray, q: qt.QType, name: str) -> np.ndarray:
    if not isinstance(weights, np.ndarray):
        raise QuantizationInputError(f"{name}: expected a numpy array, got {type(weights).__name__}")
    if weights.dtype != np.float32:
        raise QuantizationInputError(f"{name}: expected float32 weights, got {weights.dtype}")
    if weights.ndim != 2:
        raise QuantizationInputError(f"{name}: expected a 2-D matrix, got shape {tuple(weights.shape)}")
    if not weights.flags.c_contiguous:
        raise QuantizationInputError(f"{name}: weights must be C-contiguous")
    _check_row(q, weights.shape[1], name)
    if not np.isfinite(weights).all():
        bad = int((~np.isfinite(weights)).sum())
        raise QuantizationInputError(f"{name}: {bad} non-finite weight(s) (NaN/Inf); refusing to quantize to {q.name}")
    return weights


def _validate_imatrix(imatrix: np.ndarray | None, q: qt.QType, n_per_row: int, name: str) -> np.ndarray | None:
    if imatrix is None:
        if q.ggml_needs_imatrix:
            raise QuantizationInputError(f"{name}: {q.name} requires an importance matrix (none given)")
        return None
    im = np.asarray(imatrix)
    if im.dtype != np.float32:
        raise QuantizationInputError(f"{name}: imatrix must be float32, got {im.dtype}")
    im = np.ascontiguousarray(im.reshape(-1)) if im.ndim == 1 else im
    if im.ndim != 1 or im.size != n_per_row:
        raise QuantizationInputError(
            f"{name}: imatrix has {im.size} values, expected one per column ({n_per_row})"
        )
    if not np.isfinite(im).all() or (im < 0).any():
        raise QuantizationInputError(f"{name}: imatrix has negative or non-finite values")
    if not (im > 0).any():
        # An all-zero imatrix fits nothing: the quantizer returns all-zero weights.
        raise QuantizationInputError(f"{name}: imatrix is all zeros")
    return im


@lru_cache(maxsize=None)
def _load(path: str) -> GGML:
    return GGML(Path(path))


def lib(path: str | Path | None = None) -> GGML:
    """The process-wide handle of libggml-base (located via :func:`paths.ggml_lib_path`)."""
    return _load(str(Path(path) if path else paths.ggml_lib_path()))


def quantize(weights: np.ndarray, qtype: str | qt.QType, imatrix: np.ndarray | None = None, **kw) -> bytes:
    return lib().quantize(weights, qtype, imatrix, **kw)


def dequantize(data, qtype: str | qt.QType, shape: tuple[int, ...], **kw) -> np.ndarray:
    return lib().dequantize(data, qtype, shape, **kw)
