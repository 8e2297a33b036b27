"""Writing codes back into packed blocks: the inverse of the code fields the kernels read.

For the 256-weight superblock types whose codes are integers or one 16-value codebook (Q2_K,
Q3_K, Q4_K, Q5_K, Q6_K, IQ4_XS), :func:`recode` takes blocks of ggml bytes and new codes in the
kernels' convention (:class:`.Affine`'s ``code``, element order) and returns the same blocks with
their code fields rewritten; the scales, offsets and ``d`` stay as they are. Dequantizing the
result gives ``scale · code (+ offset)`` with the blocks' own scales: what a walk that rounds with
those scales held fixed (candidates/fixed_rounding.py) computed, to the bit. The layouts are
those of ``ggml-common.h``, read by :mod:`.kquants` and :mod:`.iquants`; the tests check every
type against libggml-base's own bytes (its blocks recoded with its own codes are unchanged) and
its dequantization of recoded blocks.
"""

from __future__ import annotations

import torch

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from .grids import table

# code range (the Affine convention) and the byte offset of the code fields, per type
_RANGE = {"Q2_K": (0, 3), "Q3_K": (-4, 3), "Q4_K": (0, 15), "Q5_K": (0, 31), "Q6_K": (-32, 31)}
TYPES = frozenset({*_RANGE, "IQ4_XS"})


def supports(qtype: str | qt.QType) -> bool:
    return qt.get(qtype).name in TYPES


def _shifted(q: torch.Tensor, shifts: torch.Tensor, dim: int) -> torch.Tensor:
    """Σ over `dim` of q << shifts (the parts occupy disjoint bits): one byte per position."""
    return (q << shifts).sum(dim).to(torch.uint8)


def _runs_to_nibbles(q: torch.Tensor) -> torch.Tensor:
    """(n, 8 runs, 32) codes < 16 -> (n, 128) bytes: chunk j's low nibbles hold run 2j, its high
    nibbles run 2j + 1 (kquants._nibble_runs)."""
    n = q.shape[0]
    pair = q.view(n, 4, 2, 32)
    return (pair[:, :, 0] | (pair[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)


def recode(blocks: torch.Tensor, qtype: str | qt.QType, code: torch.Tensor) -> torch.Tensor:
    """`blocks` ((n, type_size) uint8) with their codes replaced by `code` ((n, 256) integers in
    the type's range; for IQ4_XS values of ``kvalues_iq4nl``). A new tensor; `blocks` is unchanged."""
    q = qt.get(qtype)
    if q.name not in TYPES:
        raise QuantizationInputError(f"no code writer for {q.name}")
    if blocks.dtype != torch.uint8 or blocks.ndim != 2 or blocks.shape[1] != q.type_size:
        raise QuantizationInputError(f"{q.name}: blocks must be (n, {q.type_size}) uint8, got {blocks.dtype} {tuple(blocks.shape)}")
    n = blocks.shape[0]
    if tuple(code.shape) != (n, 256):
        raise QuantizationInputError(f"{q.name}: codes must be ({n}, 256), got {tuple(code.shape)}")
    dev = blocks.device
    c = code.to(device=dev, dtype=torch.int64)
    out = blocks.clone()
    if q.name == "IQ4_XS":
        kv = table("kvalues_iq4nl", dev).to(torch.int64)  # int8 values, distinct
        lut = torch.full((256,), -1, dtype=torch.int64, device=dev)
        lut[kv + 128] = torch.arange(16, device=dev)
        nib = lut[(c + 128).clamp(0, 255)]
        if bool((nib < 0).any()) or bool((c < -128).any()) or bool((c > 127).any()):
            raise QuantizationInputError("IQ4_XS: a code is not a value of kvalues_iq4nl")
        nib = nib.view(n, 8, 2, 16)  # sub-block, half, position
        out[:, 8:136] = (nib[:, :, 0] | (nib[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
        return out
    lo, hi = _RANGE[q.name]
    if bool((c < lo).any()) or bool((c > hi).any()):
        raise QuantizationInputError(f"{q.name}: codes outside {lo}..{hi}")
    crumb = torch.arange(0, 8, 2, device=dev).view(1, 1, 4, 1)  # 2-bit fields at shifts 0, 2, 4, 6
    if q.name == "Q2_K":  # qs[64] at 16: half h, shift k, position l <- weight h·128 + k·32 + l
        out[:, 16:80] = _shifted(c.view(n, 2, 4, 32), crumb, 2).reshape(n, 64)
    elif q.name == "Q3_K":  # hmask[32] at 0 (bit r of byte l: run r's high bit), qs[64] at 32
        u = c + 4
        out[:, 32:96] = _shifted((u & 3).view(n, 2, 4, 32), crumb, 2).reshape(n, 64)
        bit = torch.arange(8, device=dev).view(1, 8, 1)
        out[:, 0:32] = _shifted((u >> 2).view(n, 8, 32), bit, 1)
    elif q.name == "Q4_K":  # qs[128] at 16
        out[:, 16:144] = _runs_to_nibbles(c.view(n, 8, 32))
    elif q.name == "Q5_K":  # qh[32] at 16 (bit g of byte l: run g's fifth bit), qs[128] at 48
        out[:, 48:176] = _runs_to_nibbles((c & 15).view(n, 8, 32))
        bit = torch.arange(8, device=dev).view(1, 8, 1)
        out[:, 16:48] = _shifted((c >> 4).view(n, 8, 32), bit, 1)
    else:  # Q6_K: ql[128] at 0, qh[64] at 128; half h, run k = 2·nibble + byte run
        u = (c + 32).view(n, 2, 2, 2, 32)  # half, nibble, byte run, position
        low = u & 15
        out[:, 0:128] = (low[:, :, 0] | (low[:, :, 1] << 4)).reshape(n, 128).to(torch.uint8)
        out[:, 128:192] = _shifted((u >> 4).view(n, 2, 4, 32), crumb, 2).reshape(n, 64)
    return out
