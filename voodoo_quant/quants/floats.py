"""Unquantized storage types: F32, F16, BF16 (one weight per "block").

ggml widens F16 with GGML_FP16_TO_FP32 and BF16 with ``ggml_bf16_to_fp32`` (the 16 bits moved
to the top of a float32, ``ggml/src/ggml-impl.h``); both are exact, as are torch's casts.
BF16 is widened by placing its two bytes above two zero bytes, so NaN payloads survive unchanged too.
"""

from __future__ import annotations

import torch

from ._registry import register


@register("F32")
def f32(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float32)


@register("F16")
def f16(blocks: torch.Tensor) -> torch.Tensor:
    return blocks.contiguous().view(torch.float16).float()


@register("BF16")
def bf16(blocks: torch.Tensor) -> torch.Tensor:
    zeros = torch.zeros_like(blocks)
    # bytes (0, 0, lo, hi): the little-endian float32 whose top half is the bf16; pure byte moves
    return torch.cat([zeros, blocks], dim=1).contiguous().view(torch.float32)
