"""Plain decoders: the Llama family (SmolLM2 is one) and Qwen3.

llama.cpp's converter permutes Llama's q/k rows for its rope layout (conversion/llama.py
``LlamaModel.permute``); the exact map comes from :mod:`voodoo_quant.layout`, the names below
serve where no checkpoint is at hand (tensor-type files, imatrix names, reports).
"""

from __future__ import annotations

from .base import ArchAdapter, register

# gguf-py tensor_mapping.py names for the standard decoder blocks.
DECODER_GGUF_NAMES: tuple[tuple[str, str], ...] = (
    (r"model\.embed_tokens\.weight", "token_embd.weight"),
    (r"lm_head\.weight", "output.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.self_attn\.q_proj\.weight", "blk.{bid}.attn_q.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.self_attn\.k_proj\.weight", "blk.{bid}.attn_k.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.self_attn\.v_proj\.weight", "blk.{bid}.attn_v.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.self_attn\.o_proj\.weight", "blk.{bid}.attn_output.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.mlp\.gate_proj\.weight", "blk.{bid}.ffn_gate.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.mlp\.up_proj\.weight", "blk.{bid}.ffn_up.weight"),
    (r"model\.layers\.(?P<bid>\d+)\.mlp\.down_proj\.weight", "blk.{bid}.ffn_down.weight"),
)


@register
class LlamaAdapter(ArchAdapter):
    name = "llama"
    model_types = ("llama",)
    attention_segments = ("self_attn.",)
    gguf_names = DECODER_GGUF_NAMES


@register
class Qwen3Adapter(ArchAdapter):
    name = "qwen3"
    model_types = ("qwen3",)
    attention_segments = ("self_attn.",)
    gguf_names = DECODER_GGUF_NAMES
