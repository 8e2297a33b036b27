"""LFM2 / LFM2.5: short-conv blocks + GQA attention.

Verified at the pinned commit (conversion/lfm2.py): the converter writes ``token_embd`` in the
usual [vocab, hidden] layout (no transpose) and only squeezes the short-conv kernel, which
llama-quantize never quantizes (src/llama-quant.cpp: ``shortconv.conv.weight``). The short-conv
``in_proj`` is one fused [B | C | x] matrix: three equal row groups, kept together under TP.
"""

from __future__ import annotations

from ..distributed.parallel import LayerShard, Shard
from .base import ArchAdapter, attention_shards, mlp_shards, register

_P = r"model\.layers\.(?P<bid>\d+)\."


@register
class Lfm2Adapter(ArchAdapter):
    name = "lfm2"
    model_types = ("lfm2",)
    attention_segments = ("self_attn.", "conv.")
    # HF name pattern → number of equal row groups fused in that tensor.
    fused_row_groups = ((r".*\.conv\.in_proj\.weight", 3),)
    gguf_names = (
        (r"model\.embed_tokens\.weight", "token_embd.weight"),
        (r"lm_head\.weight", "output.weight"),
        (_P + r"self_attn\.q_proj\.weight", "blk.{bid}.attn_q.weight"),
        (_P + r"self_attn\.k_proj\.weight", "blk.{bid}.attn_k.weight"),
        (_P + r"self_attn\.v_proj\.weight", "blk.{bid}.attn_v.weight"),
        (_P + r"self_attn\.out_proj\.weight", "blk.{bid}.attn_output.weight"),
        (_P + r"conv\.in_proj\.weight", "blk.{bid}.shortconv.in_proj.weight"),
        (_P + r"conv\.out_proj\.weight", "blk.{bid}.shortconv.out_proj.weight"),
        (_P + r"feed_forward\.w1\.weight", "blk.{bid}.ffn_gate.weight"),
        (_P + r"feed_forward\.w3\.weight", "blk.{bid}.ffn_up.weight"),
        (_P + r"feed_forward\.w2\.weight", "blk.{bid}.ffn_down.weight"),
    )

    def shard_layer(self, layer, world: int):
        """Attention layers: heads (out_proj row-parallel). Short-conv layers: the fused
        ``[B | C | x]`` in_proj split group by group, so each rank holds matching B, C and x rows,
        the depthwise conv by the same channels, out_proj by those columns. The feed-forward
        w1/w3 column-, w2 row-parallel."""
        params = mlp_shards(layer.feed_forward, "feed_forward.", gate="w1", up="w3", down="w2")
        if getattr(layer, "is_attention_layer", hasattr(layer, "self_attn")):
            params.update(attention_shards(layer.self_attn, "self_attn.", out_name="out_proj"))
        else:
            conv = layer.conv
            h = conv.out_proj.weight.shape[1]
            params["conv.in_proj.weight"] = Shard.fused_rows((h, 1), (h, 1), (h, 1))
            if conv.in_proj.bias is not None:
                params["conv.in_proj.bias"] = Shard.fused_rows((h, 1), (h, 1), (h, 1))
            params["conv.conv.weight"] = Shard.rows(h)
            if conv.conv.bias is not None:
                params["conv.conv.bias"] = Shard.rows(h)
            params["conv.out_proj.weight"] = Shard.cols(h)
        return LayerShard(params=params)
