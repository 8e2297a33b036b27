"""The Hessians file of ``--error_compensation``: written as it is collected, read mapped.

A standard safetensors file (8-byte little-endian header length, JSON header, raw data), so any
safetensors reader opens it. The header's ``__metadata__`` holds the format, the key of the inputs
the Hessians were collected from, and which tensors share another's Hessian (q/k/v, gate/up read
one input: stored once). Every stored Hessian is a float32 n × n matrix in the GGUF tensor's
column order, keyed by the HF tensor name.

Writing takes the arrays one at a time, each written at the offset the header declares for it
(the sizes are given up front), in any order: a collection pass's (or one decoder layer's)
Hessians are the only ones in memory, whatever the model's size, and the file is the same bytes
whatever order they came in. Reading maps the file: a :class:`~voodoo_quant.candidates.compensate.Compensation`
holds a read-only view, paged in when its candidates are built. Both are checked: the header's
entries must be square float32 matrices lying inside the file, and each array written must be
the one declared next.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Iterable, Mapping
from pathlib import Path

import numpy as np

from ..core import fileio
from ..core.errors import CorruptFileError, QuantizationInputError

FORMAT = "voodoo-hessians/2"
FILE = "hessians.safetensors"
_MAX_HEADER = 64 << 20


def write_hessians(path: str | os.PathLike, sizes: Mapping[str, int], shared: Mapping[str, str], key: str,
                   arrays: Iterable[tuple[str, np.ndarray]]) -> Path:
    """Write `sizes` (stored name → n, in the order the file holds them) atomically, from
    `arrays` in any order, each name once; `shared` maps each other tensor to the stored name whose
    Hessian it reads."""
    bad = {k: v for k, v in shared.items() if v not in sizes or k in sizes}
    if bad:
        raise QuantizationInputError(f"shared Hessians must name a stored one: {bad}")
    header: dict = {"__metadata__": {"format": FORMAT, "key": str(key), "shared": json.dumps(dict(shared), sort_keys=True)}}
    offset = 0
    for name, n in sizes.items():
        nbytes = 4 * int(n) * int(n)
        header[name] = {"dtype": "F32", "shape": [int(n), int(n)], "data_offsets": [offset, offset + nbytes]}
        offset += nbytes
    raw = json.dumps(header, separators=(",", ":")).encode()
    raw += b" " * (-len(raw) % 8)  # the data starts 8-aligned

    def write(tmp: Path) -> None:
        base = 8 + len(raw)
        written: set[str] = set()
        with open(tmp, "wb") as fh:
            fh.write(struct.pack("<Q", len(raw)) + raw)
            for name, arr in arrays:
                if name not in sizes or name in written:
                    raise QuantizationInputError(f"Hessian {name!r} was not declared, or is written twice")
                n = int(sizes[name])
                a = np.ascontiguousarray(arr, dtype="<f4")
                if a.shape != (n, n):
                    raise QuantizationInputError(f"Hessian {name!r} is {a.shape}, declared ({n}, {n})")
                fh.seek(base + header[name]["data_offsets"][0])  # at its declared offset, whatever the order
                fh.write(memoryview(a).cast("B"))
                written.add(name)
            missing = [k for k in sizes if k not in written]
            if missing:
                raise QuantizationInputError(f"{len(missing)} declared Hessian(s) never written, e.g. {missing[0]!r}")

    return fileio.write_with(path, write)


def read_key(path: str | os.PathLike) -> str | None:
    """The key a Hessians file was written with; None for a file of another format."""
    try:
        meta, _, _ = _header(Path(path))
    except CorruptFileError:
        return None
    return meta.get("key")


def load_hessians(path: str | os.PathLike, *, key: str | None = None) -> dict[str, np.ndarray] | None:
    """HF tensor name → read-only mapped float32 Hessian (shared ones the same array); None when
    `key` is given and the file was collected from other inputs."""
    p = Path(path)
    meta, entries, base = _header(p)
    if key is not None and meta.get("key") != key:
        return None
    size = p.stat().st_size
    out: dict[str, np.ndarray] = {}
    for name, e in entries.items():
        if not isinstance(e, dict):
            raise CorruptFileError(f"{p}: entry {name} is not a tensor")
        shape, offs = e.get("shape"), e.get("data_offsets")
        ok = (e.get("dtype") == "F32" and isinstance(shape, list) and len(shape) == 2 and shape[0] == shape[1]
              and isinstance(shape[0], int) and shape[0] > 0 and isinstance(offs, list) and len(offs) == 2
              and offs[1] - offs[0] == 4 * shape[0] * shape[1] and 0 <= offs[0] and base + offs[1] <= size)
        if not ok:
            raise CorruptFileError(f"{p}: entry {name} is not a square float32 matrix inside the file")
        out[name] = np.memmap(p, dtype="<f4", mode="r", offset=base + offs[0], shape=tuple(shape))
    try:
        shared = json.loads(meta.get("shared") or "{}")
    except json.JSONDecodeError as e:
        raise CorruptFileError(f"{p}: unreadable shared map ({e})") from None
    for name, owner in shared.items():
        if owner not in out:
            raise CorruptFileError(f"{p}: {name} shares the Hessian of {owner}, which it does not hold")
        out[str(name)] = out[owner]
    return out


def _header(p: Path) -> tuple[dict, dict, int]:
    try:
        with open(p, "rb") as fh:
            head = fh.read(8)
            n = struct.unpack("<Q", head)[0] if len(head) == 8 else -1
            if not 0 < n <= _MAX_HEADER:
                raise CorruptFileError(f"{p} is not a safetensors file")
            header = json.loads(fh.read(n))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise CorruptFileError(f"{p}: unreadable Hessians file ({e})") from None
    meta = header.pop("__metadata__", None) if isinstance(header, dict) else None
    if not isinstance(meta, dict) or meta.get("format") != FORMAT:
        raise CorruptFileError(f"{p} is not a voodoo Hessians file ({FORMAT})")
    return meta, header, 8 + n
