"""Lookup tables of the IQ types and MXFP4, derived from libggml-base itself.

Choice: rather than paste llama.cpp's tables (``iq2xxs_grid``, ``iq2xs_grid``, ``iq2s_grid``,
``iq3xxs_grid``, ``iq3s_grid``, ``iq1s_grid``, ``ksigns_iq2xs``, ``kvalues_iq4nl``,
``kvalues_mxfp4`` in ``ggml/src/ggml-common.h``) into Python, each table is read back out of the
loaded library: we craft blocks whose scale makes the block multiplier an exact power of two and
whose grid index runs over every entry, and dequantize them once with ggml's own ``to_float``.
The tables are therefore exactly those of the library the candidates were quantized with. They
are cheap (well under a millisecond of C time each) and cached in memory, per device.
Tests compare them with the independent copies in the PyPI ``gguf`` package.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np
import torch

from ..core import ggml
from ..core import qtypes as qt

_F16_ONE = np.float16(1.0).view(np.uint16)  # 0x3C00


def _blocks(qtype: str, n: int) -> np.ndarray:
    """`n` zeroed blocks of `qtype` as an (n, type_size) uint8 array."""
    return np.zeros((n, qt.get(qtype).type_size), dtype=np.uint8)


def _set_u16(b: np.ndarray, off: int, values) -> None:
    v = np.asarray(values, dtype=np.uint16)
    b[..., off:off + 2 * v.shape[-1]] = v.astype("<u2").view(np.uint8).reshape(*v.shape[:-1], -1)


def _to_float(qtype: str, b: np.ndarray) -> np.ndarray:
    q = qt.get(qtype)
    return ggml.lib().dequantize(np.ascontiguousarray(b), q, (b.shape[0], q.block), name=f"{q.name} table probe").reshape(-1)


def _nibble_probe(qtype: str, scale_off: int, qs_off: int) -> np.ndarray:
    """kvalues of a 16-entry nibble codebook: one block, scale 1, byte j = j | j << 4."""
    b = _blocks(qtype, 1)
    if scale_off >= 0:
        _set_u16(b, scale_off, [[_F16_ONE]])
    else:  # MXFP4: E8M0 exponent 128 is a scale of exactly 1 (GGML_E8M0_TO_FP32_HALF)
        b[:, 0] = 128
    b[0, qs_off:qs_off + 16] = np.arange(16, dtype=np.uint8) * 17
    return _to_float(qtype, b).reshape(-1)[:16].astype(np.int8)


def _grid_from_indices(qtype: str, n_entries: int, per_block: int, fill, mult: float) -> np.ndarray:
    """Dequantize blocks that list the indices 0..n_entries-1 in order, with every sign positive
    and a block multiplier of `mult` (a power of two, so dividing it out is exact)."""
    n = n_entries // per_block
    b = _blocks(qtype, n)
    _set_u16(b, 0, np.full((n, 1), _F16_ONE))
    idx = np.arange(n_entries, dtype=np.int64).reshape(n, per_block)
    fill(b, idx)
    return _to_float(qtype, b) / np.float32(mult)


def _fill_iq2_xxs(b, idx):  # qs: per 32 weights, 4 index bytes then a uint32 (signs 0, scale 0)
    v = np.zeros((b.shape[0], 8, 8), dtype=np.uint8)
    v[:, :, 0:4] = idx.reshape(-1, 8, 4)
    b[:, 2:66] = v.reshape(b.shape[0], 64)


def _fill_iq2_xs(b, idx):  # qs: uint16 = index | signs << 9; scales 0
    _set_u16(b, 2, idx)


def _fill_iq2_s(b, idx):  # qs low bytes; qh[ib] holds bits 8-9 of index l at bits 2l..2l+1
    b[:, 2:34] = idx & 0xFF
    hi = (idx >> 8).reshape(-1, 8, 4) << np.arange(0, 8, 2)
    b[:, 66:74] = hi.sum(axis=2)


def _fill_iq3_xxs(b, idx):  # qs: one index byte per 4 weights; aux32 0 -> signs +, db = d/4
    b[:, 2:66] = idx


def _fill_iq3_s(b, idx):  # qs low bytes; qh[k] bit m is bit 8 of index 8k+m; scales 0 -> db = d
    b[:, 2:66] = idx & 0xFF
    b[:, 66:74] = ((idx >> 8).reshape(-1, 8, 8) << np.arange(8)).sum(axis=2)


def _fill_iq1_s(b, idx):  # qs low bytes; qh[ib] bits 3l..3l+2 = index bits 8-10; scale bits 0
    b[:, 2:34] = idx & 0xFF
    _set_u16(b, 34, ((idx >> 8).reshape(-1, 8, 4) << np.arange(0, 12, 3)).sum(axis=2))


@lru_cache(maxsize=None)
def _numpy_table(name: str) -> np.ndarray:
    if name == "kvalues_iq4nl":
        return _nibble_probe("IQ4_NL", 0, 2)
    if name == "kvalues_mxfp4":
        return _nibble_probe("MXFP4", -1, 1)
    if name == "iq2xxs_grid":  # db = d * 0.5 * 0.25
        return _grid_from_indices("IQ2_XXS", 256, 32, _fill_iq2_xxs, 0.125).reshape(256, 8)
    if name == "iq2xs_grid":
        return _grid_from_indices("IQ2_XS", 512, 32, _fill_iq2_xs, 0.125).reshape(512, 8)
    if name == "iq2s_grid":
        return _grid_from_indices("IQ2_S", 1024, 32, _fill_iq2_s, 0.125).reshape(1024, 8)
    if name == "iq3xxs_grid":  # db = d * 0.5 * 0.5
        return _grid_from_indices("IQ3_XXS", 256, 64, _fill_iq3_xxs, 0.25).reshape(256, 4)
    if name == "iq3s_grid":
        return _grid_from_indices("IQ3_S", 512, 64, _fill_iq3_s, 1.0).reshape(512, 4)
    if name == "iq1s_grid":  # y = 1 * (grid + IQ1S_DELTA); the subtraction is exact
        return (_grid_from_indices("IQ1_S", 2048, 32, _fill_iq1_s, 1.0) - np.float32(0.125)).reshape(2048, 8)
    if name == "ksigns_iq2xs":
        # IQ2_XS with grid index 0 (all entries positive) and sign index s: the sign pattern of
        # ksigns_iq2xs[s], as the 8 factors (+1/-1) ggml multiplies by.
        y = _grid_from_indices("IQ2_XS", 128, 32, lambda b, idx: _set_u16(b, 2, idx << 9), 0.125)
        return np.where(y.reshape(128, 8) < 0, np.float32(-1.0), np.float32(1.0))
    raise KeyError(f"no ggml table named {name!r}")


TABLES: tuple[str, ...] = (
    "kvalues_iq4nl", "kvalues_mxfp4", "iq2xxs_grid", "iq2xs_grid", "iq2s_grid", "iq3xxs_grid",
    "iq3s_grid", "iq1s_grid", "ksigns_iq2xs",
)


def numpy_table(name: str) -> np.ndarray:
    """A read-only copy-free view of table `name` (float32; int8 for the kvalues)."""
    t = _numpy_table(name)
    t.setflags(write=False)
    return t


@lru_cache(maxsize=None)
def _torch_table(name: str, device: str) -> torch.Tensor:
    return torch.from_numpy(numpy_table(name).astype(np.float32)).to(device)


def table(name: str, device: torch.device | str) -> torch.Tensor:
    """Table `name` as a float32 tensor on `device` (cached: one upload per device)."""
    return _torch_table(name, str(torch.device(device)))
