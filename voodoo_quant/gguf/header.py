"""Reading a GGUF file's header: its key/values and its tensor infos, laid out and checked as
``ggml/src/gguf.cpp`` (``gguf_init_from_reader``) reads them at the pinned commit, in pure Python
(gguf-py's ``GGUFReader`` takes seconds on a large vocabulary; this takes a fraction of one).

Public API::

    read_file(path, what) -> (kv, [(name, ne (ggml order), ggml type id, offset)], data start)
    read_header(raw, size=None) -> the same, from the file's first bytes
    tensor_nbytes(ne, type id) -> bytes of one tensor's data
    tensor_table(path) -> {name: (ggml type, shape rows-first, raw bytes)}
    Reader(raw, size=None)  # a little-endian cursor over bytes (also the legacy imatrix reader's)
    MALFORMED               # what a header cut short raises (a caller may read more and retry)

:func:`read_header` refuses with :class:`CorruptFileError` what gguf.cpp refuses, so a file it
accepts is one the stock tools open, and nothing downstream (numpy views, libggml) sees a tensor
whose type, row length or data it cannot trust:

- **magic** ``GGUF``; **version** 2 or 3 (gguf.cpp: "GGUFv1 is no longer supported", and "only
  supports up to version 3");
- **counts** of key/values and tensors not negative (nor, given the file's `size`, more than
  its bytes could hold);
- **key/values**: keys not empty nor repeated; a value of a known gguf_type, arrays not nested;
  ``general.alignment`` a UINT32 power of two (32 when absent, ``GGUF_DEFAULT_ALIGNMENT``);
- **tensor infos**: names shorter than ``GGML_MAX_NAME`` (64) and not repeated; at most
  ``GGML_MAX_DIMS`` (4) dims, none negative; a ggml type the project's type table holds
  (``core/qtypes.py``; gguf.cpp knows a few more, which nothing here can size or read); a row
  length (``ne[0]``) that is a multiple of the type's block; each tensor's data offset the end of
  the one before, padded to the alignment (gguf.cpp: "tensor '%s' has offset %zu, expected %zu"),
  so every offset is aligned and no two tensors overlap.

Whether each tensor's data lies inside the file needs the file's size: :func:`read_file` checks it
(``llama-model-loader.cpp``: "tensor data is not within the file bounds"), and a caller of
:func:`read_header` that reads the data checks it against its bytes.

Bytes that run out are not :class:`CorruptFileError` but one of :data:`MALFORMED` (``struct.error``
for a number, ``ValueError`` for a string): `raw` may be only the start of the file, and a caller
may read more and try again (:func:`read_file` does; with the whole file read it is
:class:`CorruptFileError`). A string of non-UTF-8 bytes raises ``UnicodeDecodeError``, also in
:data:`MALFORMED` (``tests/test_fuzz_readers.py`` feeds the readers truncated and bit-flipped
files; ``tests/test_gguf_header.py`` crafts each refusal above).
"""

from __future__ import annotations

import math
import struct
from pathlib import Path

from ..core import qtypes as qt
from ..core.errors import CorruptFileError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (ggml/include/gguf.h)
GGML_MAX_DIMS, GGML_MAX_NAME = 4, 64  # ggml/include/ggml.h
# gguf_type values (ggml/include/gguf.h)
T_UINT32, T_STRING, T_ARRAY = 4, 8, 9
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
# the fewest bytes a key/value (u64 key length, a 1-byte key, i32 type, a 1-byte value) and a
# tensor info (u64 name length, u32 n_dims, i32 type, u64 offset) take
_MIN_KV, _MIN_INFO = 14, 24

# What a truncated or malformed header (or legacy imatrix) raises besides CorruptFileError: the
# bytes running out (struct.error, ValueError), a string that is not UTF-8, and what a caller's
# use of a metadata value of the wrong GGUF type may raise (TypeError, KeyError, ...).
MALFORMED = (struct.error, ValueError, IndexError, KeyError, UnicodeDecodeError, TypeError, ZeroDivisionError,
             OverflowError, RecursionError, MemoryError)


class Reader:
    """A little-endian cursor over `raw`: :meth:`take` numbers (``struct`` format without the
    ``<``), :meth:`bytes` and :meth:`string` (u64 length + UTF-8), each bounds-checked. `size`:
    the whole file's size when `raw` is only its start; a length that runs past the file (not
    merely past `raw`) is then :class:`CorruptFileError`, as reading more cannot help."""

    def __init__(self, raw: bytes, size: int | None = None):
        self.raw, self.pos, self.size = raw, 0, size

    def take(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.raw, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals if len(vals) > 1 else vals[0]

    def bytes(self, n: int) -> bytes:
        if self.size is not None and n > 0 and self.pos + n > self.size:
            raise CorruptFileError(f"a length of {n:,} bytes at offset {self.pos:,} runs past the end of the file "
                                   f"({self.size:,} bytes)")
        if n < 0 or self.pos + n > len(self.raw):
            raise ValueError(f"needs {n} bytes at offset {self.pos}, file has {len(self.raw)}")
        b = self.raw[self.pos:self.pos + n]
        self.pos += n
        return b

    def string(self) -> str:
        return self.bytes(self.take("Q")).decode()


def _read_value(r: Reader, t: int, key: str):
    if t == T_STRING:
        return r.string()
    if t == T_ARRAY:
        at, n = r.take("iQ")
        if at == T_ARRAY:  # gguf.cpp: "key '%s' has invalid GGUF type"
            raise CorruptFileError(f"key {key!r} is an array of arrays, which GGUF does not allow")
        if at != T_STRING and at not in _SCALAR_FMT:
            raise CorruptFileError(f"key {key!r} is an array of unknown GGUF value type {at}")
        if at in _SCALAR_FMT and r.size is not None and r.pos + n * struct.calcsize(_SCALAR_FMT[at]) > r.size:
            raise CorruptFileError(f"key {key!r}: an array of {n:,} values runs past the end of the file")
        return [_read_value(r, at, key) for _ in range(n)]
    if t not in _SCALAR_FMT:
        raise CorruptFileError(f"key {key!r} has unknown GGUF value type {t}")
    return r.take(_SCALAR_FMT[t])


def tensor_nbytes(ne: list[int], gtype: int) -> int:
    """Bytes of the data of a tensor of dims `ne` (ggml order) and ggml type id `gtype`, both
    checked by :func:`read_header`."""
    q = qt.by_id(gtype)
    return math.prod(ne[1:]) * ((ne[0] if ne else 1) // q.block) * q.type_size


def _check_info(name: str, ne: list[int], gtype: int) -> None:
    """gguf.cpp's checks of one tensor info (``gguf_init_from_reader``, "read the tensor info")."""
    if len(ne) > GGML_MAX_DIMS:
        raise CorruptFileError(f"tensor {name} has {len(ne)} dimensions, at most {GGML_MAX_DIMS} are allowed")
    if any(d < 0 for d in ne):
        raise CorruptFileError(f"tensor {name} has a negative dimension {ne}")
    q = qt.BY_ID.get(gtype)
    if q is None:
        raise CorruptFileError(f"tensor {name} has ggml type id {gtype}, which is not a type this package knows "
                               f"({', '.join(f'{t.name}={t.id}' for t in sorted(qt.BY_ID.values(), key=lambda t: t.id))})")
    n_per_row = ne[0] if ne else 1
    if n_per_row % q.block:
        raise CorruptFileError(f"tensor {name} of type {q.name} has {n_per_row} elements per row, not a multiple of "
                               f"its block size {q.block}")


def read_header(raw: bytes, size: int | None = None) -> tuple[dict, list[tuple[str, list[int], int, int]], int]:
    """(key/values, [(name, ne (ggml order), ggml type id, offset)], start of the data section) of
    the GGUF whose first bytes are `raw` (the whole file, or enough of its start to hold the
    header; `size`: the whole file's size, when known). Checks as the module says; raises
    :class:`CorruptFileError` naming what is wrong (not the file: the caller knows it), or one of
    :data:`MALFORMED` when `raw` ends first."""
    if raw[:4] != GGUF_MAGIC:
        raise CorruptFileError(f"not a GGUF file (magic {bytes(raw[:4])!r}, expected {GGUF_MAGIC!r})")
    r = Reader(raw, size)
    r.bytes(4)
    version, n_tensors, n_kv = r.take("Iqq")
    if not 2 <= version <= GGUF_VERSION:
        why = "GGUFv1 is no longer supported" if version == 1 else f"this reader supports versions 2 to {GGUF_VERSION}"
        raise CorruptFileError(f"GGUF version {version} is not supported ({why})")
    if n_tensors < 0 or n_kv < 0:
        raise CorruptFileError(f"negative count: {n_tensors} tensors, {n_kv} key/values")
    if size is not None and n_kv * _MIN_KV + n_tensors * _MIN_INFO > size - r.pos:
        raise CorruptFileError(f"{n_tensors:,} tensors and {n_kv:,} key/values cannot fit in {size:,} bytes")
    kv, kv_types = {}, {}
    for i in range(n_kv):
        key = r.string()
        if not key:
            raise CorruptFileError(f"key/value {i} has an empty key")
        if key in kv:
            raise CorruptFileError(f"duplicate key {key!r}")
        kv_types[key] = t = r.take("i")
        kv[key] = _read_value(r, t, key)
    align = ALIGNMENT
    if "general.alignment" in kv:
        align = kv["general.alignment"]
        if kv_types["general.alignment"] != T_UINT32:
            raise CorruptFileError(f"general.alignment must be a UINT32, is of GGUF type {kv_types['general.alignment']}")
        if align <= 0 or align & (align - 1):
            raise CorruptFileError(f"general.alignment {align} is not a power of 2")
    infos, names = [], set()
    expect = 0  # where the next tensor's data must start: the previous one's end, padded
    for _ in range(n_tensors):
        name = r.string()
        if len(name.encode()) >= GGML_MAX_NAME:
            raise CorruptFileError(f"tensor name {name[:80]!r} is {len(name.encode())} bytes, "
                                   f"GGUF allows at most {GGML_MAX_NAME - 1}")
        if name in names:
            raise CorruptFileError(f"duplicate tensor name {name}")
        names.add(name)
        n_dims = r.take("I")
        if n_dims > GGML_MAX_DIMS:
            raise CorruptFileError(f"tensor {name} has {n_dims} dimensions, at most {GGML_MAX_DIMS} are allowed")
        ne = [r.take("q") for _ in range(n_dims)]
        gtype, off = r.take("iQ")
        _check_info(name, ne, gtype)
        if off != expect:
            raise CorruptFileError(f"tensor {name} has data offset {off:,}, expected {expect:,} (each tensor's data "
                                   f"follows the previous one's, padded to the alignment {align})")
        expect += (tensor_nbytes(ne, gtype) + align - 1) // align * align
        infos.append((name, ne, gtype, off))
    return kv, infos, (r.pos + align - 1) // align * align


def _checked_in(infos, data0: int, size: int) -> str | None:
    """The first tensor whose data does not lie inside a file of `size` bytes, described; None
    when all do (``src/llama-model-loader.cpp``: "tensor data is not within the file bounds")."""
    for name, ne, gtype, off in infos:
        end = data0 + off + tensor_nbytes(ne, gtype)
        if end > size:
            return f"tensor {name} ends at byte {end:,}, the file has {size:,}"
    return None


def read_file(path: str | Path, what: str = "GGUF file") -> tuple[dict, list[tuple[str, list[int], int, int]], int]:
    """:func:`read_header` of the file at `path`, read from its start (1 MiB, grown until the
    header fits), with every tensor's data checked to lie inside the file. Every refusal is one
    :class:`CorruptFileError` naming `what` and the file; no tensor data is read."""
    path = Path(path)
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        raise CorruptFileError(f"{what} {path} does not exist") from None
    n = min(size, 1 << 20)
    while True:
        with open(path, "rb") as f:
            raw = f.read(n)
        try:
            kv, infos, data0 = read_header(raw, size)
            break
        except CorruptFileError as e:
            if raw[:4] != GGUF_MAGIC:
                raise CorruptFileError(f"{what} {path} is not a GGUF file (no GGUF magic)") from None
            raise CorruptFileError(f"{what} {path} is malformed: {e}") from None
        except MALFORMED as e:
            if n >= size:
                first = (str(e).strip().splitlines() or [""])[0]
                raise CorruptFileError(f"{what} {path} is truncated or malformed: {type(e).__name__}: {first}") from None
            n = min(size, n * 8)  # the header did not fit: read more
    bad = _checked_in(infos, data0, size)
    if bad:
        raise CorruptFileError(f"{what} {path} is truncated: {bad}")
    return kv, infos, data0


def tensor_table(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name → (ggml type, shape rows-first, raw bytes) of every tensor of a GGUF file, read whole
    after :func:`read_file` checked it; used by tests and benches that compare tensors byte for
    byte."""
    _, infos, base = read_file(path)
    raw = Path(path).read_bytes()
    out = {}
    for name, ne, gtype, off in infos:
        out[name] = (qt.by_id(gtype).name, tuple(reversed(ne)), raw[base + off: base + off + tensor_nbytes(ne, gtype)])
    return out
