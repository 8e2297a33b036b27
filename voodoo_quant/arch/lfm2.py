"""LFM2 / LFM2.5: short-conv blocks + GQA attention.

Verified at the pinned commit (conversion/lfm2.py): the converter writes ``token_embd`` in the
usual [vocab, hidden] layout (no transpose) and only squeezes the short-conv kernel, which
llama-quantize never quantizes (src/llama-quant.cpp: ``shortconv.conv.weight``). The short-conv
``in_proj`` is one fused [B | C | x] matrix: three equal row groups, kept together under TP.
"""

from __future__ import annotations

from .base import ArchAdapter, register

_P = r"model\.layers\.(?P<bid>\d+)\."


@register
class Lfm2Adapter(ArchAdapter):
    name = "lfm2"
    model_types = ("lfm2",)
    attention_segments = ("self_attn.", "conv.")
    transpose_embedding = False
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
