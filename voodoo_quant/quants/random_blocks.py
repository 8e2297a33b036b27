"""Random and adversarial packed blocks of any supported type (for kernel tests and benches).

Random code bytes are adversarial for free (every index, sign and sub-scale pattern occurs);
only the float fields need care, because ggml refuses NaN/Inf there (``ggml_validate_row_data``
in ``ggml/src/ggml-quants.c``). This module knows where those fields are (``ggml-common.h``
block structs) and fills them according to a *mode*:

- ``random``: every finite fp16 bit pattern equally likely (zeros, subnormals, both signs, 65504);
- ``zeros``: all bytes zero;
- ``max``: every byte 0xFF (all-max codes, all signs negative), scales ±65504;
- ``subnormal``: random codes, fp16 scales only subnormal (or ±0);
- ``negzero``: random codes, every scale -0.0 (the sign of a zero product must survive).
"""

from __future__ import annotations

import numpy as np

from ..core import qtypes as qt

MODES: tuple[str, ...] = ("random", "zeros", "max", "subnormal", "negzero")

# Byte offsets of the fp16 fields (d, m/dmin) inside one block.
_F16_FIELDS: dict[str, tuple[int, ...]] = {
    "Q4_0": (0,), "Q4_1": (0, 2), "Q5_0": (0,), "Q5_1": (0, 2), "Q8_0": (0,),
    "Q2_K": (80, 82), "Q3_K": (108,), "Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,),
    "IQ4_NL": (0,), "IQ4_XS": (0,), "IQ3_S": (0,), "IQ3_XXS": (0,), "IQ2_S": (0,),
    "IQ2_XS": (0,), "IQ2_XXS": (0,), "IQ1_S": (0,),
}


def _f16_bits(rng: np.random.Generator, n: int, mode: str) -> np.ndarray:
    """`n` finite fp16 bit patterns for a scale field, as uint16."""
    if mode == "zeros":
        return np.zeros(n, np.uint16)
    if mode == "max":
        return np.where(np.arange(n) % 2 == 0, 0x7BFF, 0xFBFF).astype(np.uint16)
    if mode == "negzero":
        return np.full(n, 0x8000, np.uint16)
    bits = rng.integers(0, 1 << 16, n, dtype=np.uint32).astype(np.uint16)
    if mode == "subnormal":
        return bits & np.uint16(0x83FF)
    # random: an all-ones exponent is Inf/NaN; clear its top exponent bit (stays finite).
    inf_nan = (bits & 0x7C00) == 0x7C00
    return np.where(inf_nan, bits & np.uint16(0xBFFF), bits).astype(np.uint16)


# Floats: (numpy uint dtype, exponent mask, sign bit, largest finite pattern, mantissa mask).
_FLOAT_BITS = {
    "F16": (np.uint16, 0x7C00, 0x8000, 0x7BFF, 0x03FF),
    "BF16": (np.uint16, 0x7F80, 0x8000, 0x7F7F, 0x007F),
    "F32": (np.uint32, 0x7F800000, 0x80000000, 0x7F7FFFFF, 0x007FFFFF),
}


def _float_data(q: qt.QType, n: int, rng: np.random.Generator, mode: str) -> np.ndarray:
    dt, exp, sign, top, mant = _FLOAT_BITS[q.name]
    raw = rng.integers(0, 1 << (8 * q.type_size), n, dtype=np.uint64)
    if mode == "zeros":
        raw[:] = 0
    elif mode == "max":
        raw = np.where(np.arange(n) % 2 == 0, top, top | sign).astype(np.uint64)
    elif mode == "negzero":
        raw[:] = sign
    elif mode == "subnormal":
        raw &= np.uint64(sign | mant)
    # an all-ones exponent is Inf/NaN: clear its top exponent bit (the value stays finite)
    inf_nan = (raw & np.uint64(exp)) == np.uint64(exp)
    top_exp_bit = np.uint64(sign >> 1)
    raw = np.where(inf_nan, raw & ~top_exp_bit, raw)
    return raw.astype(dt).view(np.uint8)


def random_blocks(qtype: str | qt.QType, n_blocks: int, rng: np.random.Generator, mode: str = "random") -> np.ndarray:
    """(n_blocks, type_size) uint8 blocks of `qtype` that ggml accepts as valid row data."""
    q = qt.get(qtype)
    if mode not in MODES:
        raise ValueError(f"unknown block mode {mode!r}; known: {', '.join(MODES)}")
    if q.is_float:
        return _float_data(q, n_blocks, rng, mode).reshape(n_blocks, q.type_size)
    fill = {"zeros": 0x00, "max": 0xFF}.get(mode)
    if fill is None:
        b = rng.integers(0, 256, (n_blocks, q.type_size), dtype=np.uint8)
    else:
        b = np.full((n_blocks, q.type_size), fill, dtype=np.uint8)
    if q.name == "MXFP4":  # E8M0 exponent byte 0..254 (0xFF is NaN)
        if mode != "zeros":
            b[:, 0] = np.minimum(b[:, 0], 254) if mode != "subnormal" else rng.integers(0, 2, n_blocks)
        return b
    if q.name == "IQ1_M":  # the fp16 d is the top nibble of each of the 4 uint16 scales
        sc = b[:, 48:56].copy().view("<u2")
        d = _f16_bits(rng, n_blocks, mode).astype(np.uint16)
        for k in range(4):
            sc[:, k] = (sc[:, k] & 0x0FFF) | (((d >> (4 * k)) & 0xF) << 12)
        b[:, 48:56] = sc.view(np.uint8)
        return b
    for off in _F16_FIELDS[q.name]:
        b[:, off:off + 2] = _f16_bits(rng, n_blocks, mode).astype("<u2").view(np.uint8).reshape(n_blocks, 2)
    return b
