"""Importance matrices and llama.cpp's GGUF and legacy ``.dat`` formats for them (computing one in
torch: :mod:`.imatrix_compute`).

An imatrix holds, per GGUF weight tensor, the sum of squared activations entering each input
column of its matmul (``<name>.in_sum2``) and how many rows (tokens) were summed
(``<name>.counts``). The quantizer gets one float per column: ``in_sum2 / counts``, computed
exactly as ``tools/quantize/quantize.cpp`` ``load_imatrix`` does (float32 sum divided by the
count converted to float32). A float64 division differs by an ulp now and then, and one ulp
changes K-quant bytes, so :meth:`Imatrix.vector` is the only place the division happens.

File formats follow ``tools/imatrix/imatrix.cpp`` (``save_imatrix`` / ``save_imatrix_legacy``)
and ``common/imatrix-loader.cpp`` at the pinned commit; :func:`save_gguf` writes the same bytes
``gguf_write_to_file`` writes for the same data (a test checks a round trip of a file written
by stock ``llama-imatrix``). A GGUF imatrix's header is read by :mod:`.header`.
"""

from __future__ import annotations

import hashlib
import struct
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

from ..core import fileio
from ..core.errors import ConfigError, CorruptFileError
from .header import ALIGNMENT, GGUF_MAGIC, GGUF_VERSION, MALFORMED, T_ARRAY, T_STRING, T_UINT32, Reader, read_header

# common/imatrix-loader.h
KV_DATASETS = "imatrix.datasets"
KV_CHUNK_COUNT = "imatrix.chunk_count"
KV_CHUNK_SIZE = "imatrix.chunk_size"
SUFFIX_SUMS = ".in_sum2"
SUFFIX_COUNTS = ".counts"

_GGML_F32 = 0


class ImatrixMismatchError(ConfigError):
    """The imatrix does not fit the model: unknown tensor names, missing entries, wrong lengths."""


@dataclass
class Entry:
    """Raw statistics of one tensor, as stored in the file.

    ``sums`` has ``n_mat * ne0`` float32 values (n_mat = number of experts, 1 for a dense
    tensor); ``counts`` has ``n_mat`` integers. For a legacy ``.dat`` file ``sums`` already is
    ``(sum / count) * ncall`` and ``counts == [ncall]`` (common/imatrix-loader.cpp).
    """

    sums: np.ndarray
    counts: np.ndarray

    def __post_init__(self) -> None:
        self.sums = np.ascontiguousarray(self.sums, dtype=np.float32).reshape(-1)
        self.counts = np.ascontiguousarray(self.counts, dtype=np.int64).reshape(-1)
        if self.counts.size < 1 or self.sums.size % self.counts.size:
            raise CorruptFileError(f"imatrix entry has {self.sums.size} sums for {self.counts.size} counts")


@dataclass
class Imatrix:
    entries: dict[str, Entry]
    datasets: list[str] = field(default_factory=list)
    chunk_count: int = 0
    chunk_size: int = 0
    is_legacy: bool = False
    source: Path | None = None
    sha256: str | None = None  # of the file it was loaded from

    # -- the vectors the quantizer gets ------------------------------------------------------
    def names(self) -> list[str]:
        return sorted(self.entries)

    def _vector(self, name: str) -> np.ndarray:
        e = self.entries[name]
        if self.is_legacy:
            # quantize.cpp: e[i] = sums[i] / ncall (int64 → float, float division); ncall 0 → sums.
            ncall = int(e.counts[0])
            return e.sums / np.float32(ncall) if ncall > 0 else e.sums.copy()
        ne0 = e.sums.size // e.counts.size
        out = np.empty_like(e.sums)
        for j, c in enumerate(e.counts):
            count = np.float32(c)  # (float) entry.counts[j]
            part = slice(j * ne0, (j + 1) * ne0)
            out[part] = e.sums[part] / count if count > 0 else np.float32(1.0)
        return out

    def get_vector(self, gguf_name: str, n_per_row: int, n_mat: int = 1) -> np.ndarray | None:
        """The quantizer's vector for `gguf_name`, or None when the file has no entry (stock
        llama-quantize then quantizes that tensor without one: src/llama-quant.cpp)."""
        if gguf_name not in self.entries:
            return None
        v = self._vector(gguf_name)
        if v.size != n_per_row * n_mat:
            # src/llama-quant.cpp throws "imatrix size %d is different from tensor size %d".
            raise ImatrixMismatchError(
                f"imatrix entry {gguf_name} has {v.size} values, tensor expects {n_per_row * n_mat} "
                f"({n_per_row} columns × {n_mat} matrices){self._from()}"
            )
        if not np.isfinite(v).all():
            raise ImatrixMismatchError(f"imatrix entry {gguf_name} has non-finite values{self._from()}")
        return v

    def vector(self, gguf_name: str, n_per_row: int, n_mat: int = 1) -> np.ndarray:
        """Like :meth:`get_vector`, but a missing entry is an error."""
        v = self.get_vector(gguf_name, n_per_row, n_mat)
        if v is None:
            near = [n for n in self.names() if n.split(".")[-2:] == gguf_name.split(".")[-2:]][:3]
            raise ImatrixMismatchError(
                f"imatrix has no entry for tensor {gguf_name}{self._from()}"
                + (f"; entries like it: {', '.join(near)}" if near else f"; it has {len(self.entries)} entries")
            )
        return v

    # -- hashes for the candidate cache --------------------------------------------------------
    def vector_hash(self, gguf_name: str) -> str:
        return vector_hash(self._vector(gguf_name))

    def content_hash(self) -> str:
        """Stable hash of every quantizer vector (not of the file): equal vectors, equal hash."""
        h = hashlib.sha256(b"voodoo-imatrix-v1")
        for name in self.names():
            v = self._vector(name)
            h.update(struct.pack("<Q", len(name)) + name.encode() + struct.pack("<Q", v.size))
            h.update(v.astype("<f4").tobytes())
        return h.hexdigest()

    def _from(self) -> str:
        return f" ({self.source})" if self.source else ""

    # -- writing -----------------------------------------------------------------------------
    def save_gguf(self, path: str | Path) -> Path:
        """Write the GGUF imatrix format of ``tools/imatrix/imatrix.cpp`` ``save_imatrix``."""
        return fileio.write_bytes(path, self.to_gguf_bytes())

    def to_gguf_bytes(self) -> bytes:
        kvs = [
            _kv_str("general.type", "imatrix"),
            _kv_str_arr(KV_DATASETS, self.datasets),
            _kv_u32(KV_CHUNK_COUNT, self.chunk_count),
            _kv_u32(KV_CHUNK_SIZE, self.chunk_size),
        ]
        tensors: list[tuple[str, tuple[int, ...], bytes]] = []
        for name in self.names():  # imatrix.cpp: "deterministic tensor name order"
            e = self.entries[name]
            nmat = e.counts.size
            tensors.append((name + SUFFIX_SUMS, (e.sums.size // nmat, nmat), e.sums.astype("<f4").tobytes()))
            tensors.append((name + SUFFIX_COUNTS, (1, nmat), e.counts.astype("<f4").tobytes()))
        out = bytearray(GGUF_MAGIC + struct.pack("<Iqq", GGUF_VERSION, len(tensors), len(kvs)))
        for kv in kvs:
            out += kv
        offset = 0
        for name, ne, data in tensors:
            dims = list(ne)
            while len(dims) > 1 and dims[-1] == 1:  # ggml_n_dims drops trailing 1s
                dims.pop()
            out += _str(name) + struct.pack("<I", len(dims)) + struct.pack(f"<{len(dims)}q", *dims)
            out += struct.pack("<iQ", _GGML_F32, offset)
            offset += _pad_len(len(data))
        out += b"\0" * (_pad_len(len(out)) - len(out))
        for _, _, data in tensors:
            out += data + b"\0" * (_pad_len(len(data)) - len(data))
        return bytes(out)

    def save_dat(self, path: str | Path) -> Path:
        """Write the legacy format of ``tools/imatrix/imatrix.cpp`` ``save_imatrix_legacy``."""
        out = bytearray(struct.pack("<i", len(self.entries)))
        for name in self.names():
            e = self.entries[name]
            if self.is_legacy:
                ncall, vals = int(e.counts[0]), e.sums
            else:
                if self.chunk_size <= 0:
                    raise ImatrixMismatchError("cannot write a legacy imatrix without a chunk size")
                ncall = (int(e.counts.max()) + self.chunk_size - 1) // self.chunk_size
                nmat, nval = e.counts.size, e.sums.size
                count = np.repeat(e.counts.astype(np.float32), nval // nmat)
                value = e.sums.copy()
                zero = count == 0
                value[zero], count[zero] = 1.0, 1.0  # "store 1 for partial data"
                vals = (value / count) * np.float32(ncall)
            b = name.encode()
            out += struct.pack("<i", len(b)) + b + struct.pack("<ii", ncall, vals.size)
            out += vals.astype("<f4").tobytes()
        ds = (self.datasets[-1] if self.datasets else "").encode()
        out += struct.pack("<ii", self.chunk_count, len(ds)) + ds
        return fileio.write_bytes(path, bytes(out))


# -- GGUF encoding helpers (ggml/src/gguf.cpp gguf_writer_base) ---------------------------------
def _pad_len(n: int) -> int:
    return (n + ALIGNMENT - 1) // ALIGNMENT * ALIGNMENT


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv_str(key: str, val: str) -> bytes:
    return _str(key) + struct.pack("<i", T_STRING) + _str(val)


def _kv_u32(key: str, val: int) -> bytes:
    return _str(key) + struct.pack("<iI", T_UINT32, int(val))


def _kv_str_arr(key: str, vals: list[str]) -> bytes:
    return _str(key) + struct.pack("<iiQ", T_ARRAY, T_STRING, len(vals)) + b"".join(_str(v) for v in vals)


def vector_hash(v: np.ndarray | None) -> str | None:
    if v is None:
        return None
    return hashlib.sha256(np.ascontiguousarray(v, dtype="<f4").tobytes()).hexdigest()


# -- loading ---------------------------------------------------------------------------------
def load(path: str | Path) -> Imatrix:
    """Load a GGUF or legacy ``.dat`` imatrix (detected by the GGUF magic, as
    common/imatrix-loader.cpp falls back to legacy when gguf_init_from_file fails)."""
    path = Path(path)
    try:
        raw = path.read_bytes()
    except FileNotFoundError:
        raise CorruptFileError(f"imatrix {path} does not exist") from None
    try:
        im = _parse_gguf(raw) if raw[:4] == GGUF_MAGIC else _parse_dat(raw)
    except MALFORMED as e:
        raise CorruptFileError(f"imatrix {path} is truncated or malformed: {type(e).__name__}: {e}") from None
    except CorruptFileError as e:
        raise CorruptFileError(f"imatrix {path}: {e}") from None
    im.source = path
    im.sha256 = hashlib.sha256(raw).hexdigest()
    return im


def _parse_gguf(raw: bytes) -> Imatrix:
    kv, infos, data0 = read_header(raw, len(raw))
    sums: dict[str, np.ndarray] = {}
    counts: dict[str, np.ndarray] = {}
    for name, ne, gtype, off in infos:
        n = int(np.prod(ne, dtype=np.int64))
        if gtype != _GGML_F32:
            raise CorruptFileError(f"tensor {name} has ggml type {gtype}, imatrix tensors must be F32")
        if data0 + off + 4 * n > len(raw):
            raise CorruptFileError(f"tensor {name} runs past the end of the file (truncated?)")
        arr = np.frombuffer(raw, dtype="<f4", count=n, offset=data0 + off).astype(np.float32)
        if name.endswith(SUFFIX_SUMS):
            sums[name[: -len(SUFFIX_SUMS)]] = arr
        elif name.endswith(SUFFIX_COUNTS):
            counts[name[: -len(SUFFIX_COUNTS)]] = arr
    if not sums and not counts:
        raise CorruptFileError("no imatrix data (no .in_sum2/.counts tensors)")
    entries = {}
    for name in sorted(set(sums) | set(counts)):
        if name not in sums or name not in counts:
            raise CorruptFileError(f"mismatched sums and counts for {name}")
        # imatrix-loader.cpp: counts[j] = std::lround(float)
        c = np.floor(counts[name].astype(np.float64) + 0.5).astype(np.int64)
        entries[name] = Entry(sums[name], c)
    for k in (KV_DATASETS, KV_CHUNK_COUNT, KV_CHUNK_SIZE):
        if k not in kv:  # quantize.cpp refuses such a file: "missing imatrix metadata"
            raise CorruptFileError(f"missing imatrix metadata key {k}")
    return Imatrix(entries, datasets=list(kv[KV_DATASETS]), chunk_count=int(kv[KV_CHUNK_COUNT]),
                   chunk_size=int(kv[KV_CHUNK_SIZE]))


def _parse_dat(raw: bytes) -> Imatrix:
    r = Reader(raw)
    n_entries = r.take("i")
    if n_entries < 1:
        raise CorruptFileError("not a GGUF file and no legacy imatrix entries")
    entries = {}
    for _ in range(n_entries):
        name = r.bytes(r.take("i")).decode()
        ncall, nval = r.take("ii")
        if nval < 1:
            raise CorruptFileError(f"entry {name} has {nval} values")
        vals = np.frombuffer(r.bytes(4 * nval), dtype="<f4").astype(np.float32)
        entries[name] = Entry(vals, np.array([ncall]))
    chunk_count, datasets = 0, []
    if r.pos < len(raw):  # the trailing chunk count + dataset name are optional
        chunk_count = r.take("i")
        if r.pos + 4 <= len(raw):
            n = r.take("i")
            if n > 0:
                datasets.append(r.bytes(n).decode())
    return Imatrix(entries, datasets=datasets, chunk_count=chunk_count, chunk_size=0, is_legacy=True)

