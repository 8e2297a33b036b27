"""Plain decoders: the Llama family (SmolLM2 is one), Qwen2 (Qwen2.5, Qwen2.5-Coder) and Qwen3.

llama.cpp's converter permutes Llama's q/k rows for its rope layout (conversion/llama.py
``LlamaModel.permute``); the exact map comes from :mod:`voodoo_quant.gguf.layout`, the names below
serve where no checkpoint is at hand (tensor-type files, imatrix names, reports).
"""

from __future__ import annotations

from ..distributed.parallel import LayerShard
from .base import ArchAdapter, attention_shards, mlp_shards, register

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


def decoder_shard_layer(self, layer, world: int):
    """Attention heads and MLP features split across ranks; norms (incl. Qwen3's per-head q/k
    norms) are replicated. The attention forward infers its head count from q_proj's output, and
    the query/key-value head ratio is unchanged by an even split: no attribute changes."""
    return LayerShard(params={**attention_shards(layer.self_attn, "self_attn."), **mlp_shards(layer.mlp, "mlp.")})


@register
class LlamaAdapter(ArchAdapter):
    name = "llama"
    model_types = ("llama",)
    attention_segments = ("self_attn.",)
    gguf_names = DECODER_GGUF_NAMES
    shard_layer = decoder_shard_layer


@register
class Qwen3Adapter(ArchAdapter):
    name = "qwen3"
    model_types = ("qwen3",)
    attention_segments = ("self_attn.",)
    gguf_names = DECODER_GGUF_NAMES
    shard_layer = decoder_shard_layer


@register
class Qwen2Adapter(ArchAdapter):
    """Qwen2 / Qwen2.5: a Llama decoder with biases on q/k/v (sharded with their rows); the
    converter writes them as ``blk.N.attn_{q,k,v}.bias`` and keeps them F32, as llama-quantize does."""

    name = "qwen2"
    model_types = ("qwen2",)
    attention_segments = ("self_attn.",)
    gguf_names = DECODER_GGUF_NAMES
    shard_layer = decoder_shard_layer
