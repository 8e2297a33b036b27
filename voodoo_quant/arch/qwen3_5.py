"""Qwen3.5 hybrids: Gated DeltaNet linear attention + gated full attention.

The multimodal wrapper stores the text model under ``model.language_model.``; the converter
strips ``language_model.`` (conversion/base.py ``ModelBase.filter_tensors``), so both spellings
map to the same GGUF names. The converter reorders linear-attention V heads from grouped to
tiled order (conversion/qwen.py ``_LinearAttentionVReorderBase``): rows of in_proj_qkv (V part),
in_proj_z, in_proj_a/b and the columns of out_proj. :mod:`voodoo_quant.gguf.layout` captures it.
"""

from __future__ import annotations

from ..distributed.parallel import LayerShard, Shard
from .base import ArchAdapter, attention_shards, mlp_shards, register
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

    def shard_layer(self, layer, world: int):
        """Full-attention layers: heads, with q_proj's per-head [query | gate] rows kept together.
        Gated DeltaNet layers: whole key heads and their value heads (each key head serves
        ``num_v_heads / num_k_heads`` consecutive value heads, so rank r's value heads belong to
        its key heads): in_proj_qkv and the depthwise conv1d split in their [q | k | v] groups,
        in_proj_z / in_proj_a / in_proj_b, A_log and dt_bias by value head, out_proj by value-head
        columns; the per-rank head counts and dims are set on the module."""
        params = mlp_shards(layer.mlp, "mlp.")
        attrs = {}
        if hasattr(layer, "self_attn"):
            params.update(attention_shards(layer.self_attn, "self_attn.", q_unit_factor=2))
        else:
            la = layer.linear_attn
            kd, vd, hk, hv = la.key_dim, la.value_dim, la.head_k_dim, la.head_v_dim
            qkv = Shard.fused_rows((kd, hk), (kd, hk), (vd, hv))
            params.update({
                "linear_attn.in_proj_qkv.weight": qkv,
                "linear_attn.conv1d.weight": qkv,
                "linear_attn.in_proj_z.weight": Shard.rows(vd, hv),
                "linear_attn.in_proj_a.weight": Shard.rows(la.num_v_heads),
                "linear_attn.in_proj_b.weight": Shard.rows(la.num_v_heads),
                "linear_attn.A_log": Shard.rows(la.num_v_heads),
                "linear_attn.dt_bias": Shard.rows(la.num_v_heads),
                "linear_attn.out_proj.weight": Shard.cols(vd, hv),
            })
            if la.num_k_heads % world == 0 and la.num_v_heads % world == 0:
                attrs["linear_attn"] = {"num_k_heads": la.num_k_heads // world, "num_v_heads": la.num_v_heads // world,
                                        "key_dim": kd // world, "value_dim": vd // world,
                                        "conv_dim": (2 * kd + vd) // world}
        return LayerShard(params=params, attrs=attrs)
