"""Qwen3.5 hybrids: Gated DeltaNet linear attention + gated full attention.

The multimodal wrapper stores the text model under ``model.language_model.``; the converter
strips ``language_model.`` (conversion/base.py ``ModelBase.filter_tensors``), so both spellings
map to the same GGUF names. The converter reorders linear-attention V heads from grouped to
tiled order (conversion/qwen.py ``_LinearAttentionVReorderBase``): rows of in_proj_qkv (V part),
in_proj_z, in_proj_a/b and the columns of out_proj. :mod:`voodoo_quant.layout` captures it.
"""

from __future__ import annotations

from .base import ArchAdapter, register
from .llama import DECODER_GGUF_NAMES

_P = r"model\.(?:language_model\.)?layers\.(?P<bid>\d+)\."
QWEN35_GGUF_NAMES: tuple[tuple[str, str], ...] = tuple(
    (pat.replace(r"model\.layers\.(?P<bid>\d+)\.", _P).replace(r"model\.embed", r"model\.(?:language_model\.)?embed"), tpl)
    for pat, tpl in DECODER_GGUF_NAMES
) + (
    (_P + r"linear_attn\.in_proj_qkv\.weight", "blk.{bid}.attn_qkv.weight"),
    (_P + r"linear_attn\.in_proj_z\.weight", "blk.{bid}.attn_gate.weight"),
    (_P + r"linear_attn\.in_proj_a\.weight", "blk.{bid}.ssm_alpha.weight"),
    (_P + r"linear_attn\.in_proj_b\.weight", "blk.{bid}.ssm_beta.weight"),
    (_P + r"linear_attn\.out_proj\.weight", "blk.{bid}.ssm_out.weight"),
)


@register
class Qwen35Adapter(ArchAdapter):
    name = "qwen3_5"
    model_types = ("qwen3_5", "qwen3_5_text")
    attention_segments = ("self_attn.", "linear_attn.")
    gguf_names = QWEN35_GGUF_NAMES
    strip_prefix = "model.language_model."
