"""Reading the fields of packed ggml blocks with torch ops (little-endian, as ggml writes them).

Every helper takes ``blocks``, a ``(n_blocks, type_size)`` uint8 tensor, and a byte offset, and
returns one column (or a few) per block. Byte and uint16 fields are widened to int32 (half the
memory traffic of int64 on a GPU); uint32 fields (a few per block) to int64, so that no shift
ever overflows a signed type, whose left-shift overflow is not defined on every backend.
"""

from __future__ import annotations

import torch


def f16(blocks: torch.Tensor, off: int) -> torch.Tensor:
    """The fp16 at byte `off` of every block as float32 (GGML_FP16_TO_FP32 is exact; so is this)."""
    return blocks[:, off:off + 2].contiguous().view(torch.float16).reshape(-1).float()


def u16_to_f32_via_f16(bits: torch.Tensor) -> torch.Tensor:
    """Reinterpret integer fp16 bit patterns (0..65535) as fp16, then widen to float32."""
    lo = (bits & 0xFF).to(torch.uint8)
    hi = ((bits >> 8) & 0xFF).to(torch.uint8)
    return torch.stack([lo, hi], dim=-1).view(torch.float16).squeeze(-1).float()


def u8(blocks: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """`n` unsigned bytes from `off`, as int32 (n_blocks, n)."""
    return blocks[:, off:off + n].to(torch.int32)


def raw8(blocks: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """`n` bytes from `off`, still uint8: for bit ops whose results fit in a byte (8x less memory
    traffic than int64). Never index with it: torch reads a uint8 index as a boolean mask."""
    return blocks[:, off:off + n]


def i8(blocks: torch.Tensor, off: int, n: int) -> torch.Tensor:
    """`n` signed bytes (int8_t fields) from `off`, as int8 (convert with ``.float()``)."""
    return blocks[:, off:off + n].contiguous().view(torch.int8)


def uint(blocks: torch.Tensor, off: int, n: int, width: int) -> torch.Tensor:
    """`n` little-endian unsigned integers of `width` bytes from `off` (n_blocks, n): int32 for
    uint16, int64 for uint32 (its top bit must not become a sign)."""
    dtype = torch.int64 if width > 2 else torch.int32
    b = blocks[:, off:off + n * width].to(dtype).reshape(blocks.shape[0], n, width)
    out = b[..., 0]
    for k in range(1, width):
        out = out | (b[..., k] << (8 * k))
    return out


def ar(start: int, stop: int, step: int, device) -> torch.Tensor:
    """``torch.arange`` as int32 (so that shifting an int32 field by it stays int32)."""
    return torch.arange(start, stop, step, device=device, dtype=torch.int32)


def bits(x: torch.Tensor, n: int) -> torch.Tensor:
    """The low `n` bits of integer tensor `x`, as a new last axis (bit 0 first)."""
    shifts = ar(0, n, 1, x.device)
    return (x.unsqueeze(-1) >> shifts) & 1


def sign_from_bits(b: torch.Tensor) -> torch.Tensor:
    """ggml's ``(signs & kmask_iq2xs[j] ? -1.f : 1.f)``: -1.0 where the bit is set, else 1.0."""
    return 1.0 - 2.0 * b.to(torch.float32)
