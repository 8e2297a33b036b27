"""The on-disk candidate cache: quantized bytes per (tensor content, type, imatrix, libggml).

Quantizing every selectable tensor to every type on its menu takes minutes to hours (IQ types
are slow, see docs/facts.md); the result depends only on the tensor's float32 content, the type, the
imatrix vector and the libggml version, so it is cached under a hash of exactly those.

Layout: ``<root>/<k[:2]>/<k>/data.bin`` + ``meta.json``. ``data.bin`` is written first and
``meta.json`` last, both atomically, so an entry without a valid ``meta.json`` is not an entry.
On read the entry's length (``qtypes.tensor_bytes``) and sha256 are checked against its
``meta.json``, and the meta against the key; anything off (truncated, bit-flipped, another
version) is deleted and reported as a miss, so the caller rebuilds it.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import struct
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..core import envs, fileio, ggml
from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..gguf.imatrix import vector_hash
from .compensate import applies, quantize_compensated

FORMAT = 1
DATA_FILE = "data.bin"
META_FILE = "meta.json"


def matrix_hash(matrix: np.ndarray) -> str:
    """sha256 of a float32 matrix's shape and raw bytes (little-endian)."""
    m = np.ascontiguousarray(matrix, dtype="<f4")
    h = hashlib.sha256(struct.pack("<I", m.ndim) + struct.pack(f"<{m.ndim}q", *m.shape))
    h.update(memoryview(m).cast("B"))
    return h.hexdigest()


@dataclass(frozen=True)
class CacheKey:
    content: str  # matrix_hash of the float32 tensor (GGUF layout)
    shape: tuple[int, int]
    qtype: str
    imatrix: str | None  # sha256 of the float32 imatrix vector, None = quantized without one
    lib_version: str
    # Compensation.digest_for(qtype) when the quantizer was given the error-compensated matrix
    # (compensate.py); None = the matrix itself, and the key's digest is what it always was.
    compensation: str | None = None

    @property
    def digest(self) -> str:
        fields = [FORMAT, self.content, list(self.shape), self.qtype, self.imatrix, self.lib_version]
        if self.compensation is not None:
            fields.append(self.compensation)
        return hashlib.sha256(json.dumps(fields).encode()).hexdigest()

    @property
    def nbytes(self) -> int:
        return qt.tensor_bytes(self.qtype, self.shape)


@dataclass
class CacheStats:
    hits: int = 0
    misses: int = 0
    corrupt: int = 0
    built: int = 0


def default_root() -> Path:
    return envs.cache_dir() / "candidates"


def lib_version() -> str:
    """Identity of the loaded libggml-base (version + commit): a rebuild changes the key."""
    lib = ggml.lib()
    return f"{lib.version}+{lib.commit}"


class CandidateCache:
    def __init__(self, root: str | Path | None = None):
        self.root = Path(root) if root is not None else default_root()
        self.stats = CacheStats()

    # -- keys ----------------------------------------------------------------------------------
    @staticmethod
    def key(matrix: np.ndarray, qtype: str, imatrix: np.ndarray | None = None,
            version: str | None = None, *, content: str | None = None, compensation=None) -> CacheKey:
        """Key of `matrix` (2-D float32, GGUF layout: rows × n_per_row) in `qtype`.

        `content` may pass a precomputed :func:`matrix_hash` (hashing a large tensor once for
        all of its types); `compensation` (a :class:`~voodoo_quant.candidates.compensate.Compensation`)
        keys the bytes of the compensated matrix instead (float types take none)."""
        q = qt.get(qtype)
        if matrix.ndim != 2:
            raise QuantizationInputError(f"candidate matrices are 2-D, got shape {tuple(matrix.shape)}")
        shape = (int(matrix.shape[0]), int(matrix.shape[1]))
        q.row_bytes(shape[1])  # refuses a row length the type cannot hold
        if imatrix is not None and np.asarray(imatrix).size != shape[1]:
            raise QuantizationInputError(
                f"imatrix has {np.asarray(imatrix).size} values, expected one per column ({shape[1]})"
            )
        return CacheKey(
            content=content or matrix_hash(matrix),
            shape=shape,
            qtype=q.name,
            imatrix=vector_hash(imatrix),
            lib_version=version if version is not None else lib_version(),
            compensation=compensation.digest_for(q) if compensation is not None and applies(q) else None,
        )

    def entry_dir(self, key: CacheKey) -> Path:
        d = key.digest
        return self.root / d[:2] / d

    def data_path(self, key: CacheKey) -> Path:
        return self.entry_dir(key) / DATA_FILE

    # -- read ----------------------------------------------------------------------------------
    def _check(self, key: CacheKey) -> str | None:
        """None if the entry is present and intact, else why it is not usable."""
        d = self.entry_dir(key)
        meta_p, data_p = d / META_FILE, d / DATA_FILE
        if not meta_p.exists():
            return "missing"
        try:
            meta = json.loads(meta_p.read_text(encoding="utf-8"))
        except (OSError, ValueError):
            return "meta.json unreadable"
        expect = {"format": FORMAT, "content": key.content, "shape": list(key.shape), "qtype": key.qtype,
                  "imatrix": key.imatrix, "lib_version": key.lib_version, "nbytes": key.nbytes,
                  "compensation": key.compensation}
        for k, v in expect.items():
            if meta.get(k) != v:
                return f"meta.json {k}={meta.get(k)!r}, expected {v!r}"
        try:
            size = data_p.stat().st_size
        except FileNotFoundError:
            return "data.bin missing"
        if size != key.nbytes:
            return f"data.bin has {size} bytes, expected {key.nbytes}"
        return None

    def get(self, key: CacheKey) -> bytes | None:
        """The cached bytes, or None (a corrupt entry is deleted and counted as a miss)."""
        why = self._check(key)
        if why == "missing":
            self.stats.misses += 1
            return None
        data = None
        if why is None:
            data = self.data_path(key).read_bytes()
            meta = json.loads((self.entry_dir(key) / META_FILE).read_text(encoding="utf-8"))
            if len(data) != key.nbytes or hashlib.sha256(data).hexdigest() != meta.get("sha256"):
                why, data = "data.bin checksum mismatch", None
        if data is None:
            self._drop(key)
            self.stats.corrupt += 1
            self.stats.misses += 1
            return None
        self.stats.hits += 1
        return data

    def contains(self, key: CacheKey) -> bool:
        """Cheap presence test (meta.json + length, no checksum); `get` verifies fully."""
        return self._check(key) is None

    def _drop(self, key: CacheKey) -> None:
        shutil.rmtree(self.entry_dir(key), ignore_errors=True)

    # -- write ---------------------------------------------------------------------------------
    def put(self, key: CacheKey, data: bytes, meta: dict | None = None) -> Path:
        if len(data) != key.nbytes:
            raise QuantizationInputError(
                f"{len(data)} bytes for a {key.qtype} tensor of shape {key.shape}, expected {key.nbytes}"
            )
        d = self.entry_dir(key)
        # data.bin, then meta.json, each by atomic rename. A key fixes its bytes (same matrix, type,
        # imatrix and libggml), so two processes writing one entry write the same files and a
        # reader sees a whole entry or none; a crash between the two leaves no meta (a miss) or a
        # meta that still describes the bytes (its sha256 is checked on read). meta.json is not
        # removed first: that would make an intact entry vanish under a concurrent reader.
        fileio.write_bytes(d / DATA_FILE, data)
        record = {
            **(meta or {}),
            "format": FORMAT,
            "content": key.content,
            "shape": list(key.shape),
            "qtype": key.qtype,
            "imatrix": key.imatrix,
            "lib_version": key.lib_version,
            "nbytes": key.nbytes,
            **({"compensation": key.compensation} if key.compensation is not None else {}),
            "sha256": hashlib.sha256(data).hexdigest(),
            "created": time.time(),
        }
        fileio.write_json(d / META_FILE, record)
        return d / DATA_FILE

    # -- build ---------------------------------------------------------------------------------
    def get_or_build(self, matrix: np.ndarray, qtype: str, imatrix: np.ndarray | None = None, *,
                     name: str = "tensor", key: CacheKey | None = None, workers: int | None = None,
                     compensation=None) -> bytes:
        """Cached bytes of `matrix` in `qtype`, quantizing with libggml-base on a miss (the
        error-compensated matrix with `compensation`, compensate.py)."""
        key = key or self.key(matrix, qtype, imatrix, compensation=compensation)
        data = self.get(key)
        if data is None:
            data = quantize_compensated(matrix, key.qtype, imatrix, compensation, name=name, workers=workers)
            self.put(key, data, {"name": name})
            self.stats.built += 1
        return data


def candidate(data: bytes, qtype: str, shape: tuple[int, int], dtype=None):
    """The training candidate: ggml ``to_float`` of the quantized bytes, as a torch tensor in
    `dtype` (default float32)."""
    import torch

    w = ggml.lib().dequantize(data, qtype, shape)
    t = torch.from_numpy(w)
    return t if dtype is None or dtype == torch.float32 else t.to(dtype)
