"""Reading a GGUF file's header: its key/values and its tensor infos, laid out as
``ggml/src/gguf.cpp`` (``gguf_init_from_reader``) reads them at the pinned commit, in pure Python
(gguf-py's ``GGUFReader`` takes seconds on a large vocabulary; this takes a fraction of one).

Public API::

    read_header(raw) -> (kv, [(name, ne (ggml order), ggml type id, offset)], data start)
    tensor_table(path) -> {name: (ggml type, shape rows-first, raw bytes)}
    Reader(raw)        # a little-endian cursor over bytes (also the legacy imatrix reader's)
    MALFORMED          # the exceptions a malformed header raises

What :func:`read_header` checks, and what it leaves to its callers:

- **bounds**: every read lies inside `raw`. A read past its end raises ``struct.error`` (numbers)
  or ``ValueError`` (a string whose length runs past the end), so a header cut short by a partial
  read fails and a caller may read more and try again. The counts (key/values, tensors, dims) are
  not bounded up front as gguf.cpp bounds them: a negative one reads nothing, a huge one reads
  until the bytes run out. Tensor *data* is not read: whether each tensor's bytes lie inside the
  file is the caller's check (it knows the file size and the type table).
- **version**: below 2 raises :class:`CorruptFileError` (gguf.cpp: "GGUFv1 is no longer
  supported"). A version above 3 is read with version 3's layout; gguf.cpp refuses it.
- **alignment**: the data section starts at the header's end rounded up to ``general.alignment``
  (32 when absent, ``GGUF_DEFAULT_ALIGNMENT``). An alignment of 0 raises ``ZeroDivisionError``; one
  that is not a power of two, which gguf.cpp refuses, is used as it is.
- **values**: an unknown gguf_type raises ``ValueError``, a string that is not UTF-8
  ``UnicodeDecodeError``; arrays nest as the file says (a hostile depth raises ``RecursionError``).
  Duplicate keys or tensor names are not looked for (the last key wins).

The magic is skipped, not checked: a caller that may be handed other bytes checks it first. Every
exception above but :class:`CorruptFileError` is in :data:`MALFORMED`, for a caller to turn into a
:class:`CorruptFileError` naming the file (``tests/test_fuzz_readers.py`` feeds the readers
truncated and bit-flipped files).
"""

from __future__ import annotations

import struct
from pathlib import Path

from ..core import qtypes as qt
from ..core.errors import CorruptFileError

GGUF_MAGIC = b"GGUF"
GGUF_VERSION = 3
ALIGNMENT = 32  # GGUF_DEFAULT_ALIGNMENT (ggml/include/gguf.h)
# gguf_type values (ggml/include/gguf.h)
T_UINT32, T_STRING, T_ARRAY = 4, 8, 9
_SCALAR_FMT = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}

# What a truncated or malformed header (or legacy imatrix) raises: TypeError for a metadata value
# of the wrong GGUF type, ZeroDivisionError for alignment 0, RecursionError for arrays nested
# without end (tests/test_fuzz_readers.py).
MALFORMED = (struct.error, ValueError, IndexError, KeyError, UnicodeDecodeError, TypeError, ZeroDivisionError,
             OverflowError, RecursionError, MemoryError)


class Reader:
    """A little-endian cursor over `raw`: :meth:`take` numbers (``struct`` format without the
    ``<``), :meth:`bytes` and :meth:`string` (u64 length + UTF-8), each bounds-checked."""

    def __init__(self, raw: bytes):
        self.raw, self.pos = raw, 0

    def take(self, fmt: str):
        vals = struct.unpack_from("<" + fmt, self.raw, self.pos)
        self.pos += struct.calcsize("<" + fmt)
        return vals if len(vals) > 1 else vals[0]

    def bytes(self, n: int) -> bytes:
        if n < 0 or self.pos + n > len(self.raw):
            raise ValueError(f"needs {n} bytes at offset {self.pos}, file has {len(self.raw)}")
        b = self.raw[self.pos:self.pos + n]
        self.pos += n
        return b

    def string(self) -> str:
        return self.bytes(self.take("Q")).decode()


def _read_value(r: Reader, t: int):
    if t == T_STRING:
        return r.string()
    if t == T_ARRAY:
        at, n = r.take("iQ")
        return [_read_value(r, at) for _ in range(n)]
    if t not in _SCALAR_FMT:
        raise ValueError(f"unknown GGUF value type {t}")
    return r.take(_SCALAR_FMT[t])


def read_header(raw: bytes) -> tuple[dict, list[tuple[str, list[int], int, int]], int]:
    """(key/values, [(name, ne (ggml order), ggml type id, offset)], start of the data section) of
    the GGUF whose first bytes are `raw` (the whole file, or enough of its start to hold the
    header). Checks as the module says; raises one of :data:`MALFORMED` or
    :class:`CorruptFileError`."""
    r = Reader(raw)
    r.bytes(4)
    version, n_tensors, n_kv = r.take("Iqq")
    if version < 2:
        raise CorruptFileError(f"GGUF version {version} is not supported")
    kv = {}
    for _ in range(n_kv):
        key = r.string()
        kv[key] = _read_value(r, r.take("i"))
    infos = []
    for _ in range(n_tensors):
        name = r.string()
        ne = [r.take("q") for _ in range(r.take("I"))]
        gtype, off = r.take("iQ")
        infos.append((name, ne, gtype, off))
    align = int(kv.get("general.alignment", ALIGNMENT))
    return kv, infos, (r.pos + align - 1) // align * align


def tensor_table(path: str | Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name → (ggml type, shape rows-first, raw bytes) of every tensor of a GGUF file, read whole;
    used by tests and benches that compare tensors byte for byte."""
    raw = Path(path).read_bytes()
    _, infos, base = read_header(raw)
    out = {}
    for name, ne, gtype, off in infos:
        t, shape = qt.by_id(gtype).name, tuple(reversed(ne))
        out[name] = (t, shape, raw[base + off: base + off + qt.tensor_bytes(t, shape)])
    return out
