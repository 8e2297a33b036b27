"""Architecture registry and the shipped adapters (pure data; no model needed)."""

from __future__ import annotations

import pytest

from voodoo_quant.arch import GenericAdapter, adapter_for, get_adapter, known_adapters, register
from voodoo_quant.arch.base import ArchAdapter, UnknownArchitectureError


def test_shipped_adapters_registered():
    assert {"llama", "qwen3", "qwen3_5", "qwen3_5_text", "lfm2"} <= set(known_adapters())


def test_duplicate_registration_refused():
    with pytest.raises(ValueError, match="already has adapter"):
        @register
        class Dup(ArchAdapter):
            model_types = ("llama",)


def test_unknown_lists_known():
    with pytest.raises(UnknownArchitectureError, match="known: .*llama"):
        get_adapter("no_such_model")
    cfg = type("C", (), {"model_type": "no_such_model"})()
    assert isinstance(adapter_for(cfg), GenericAdapter)


@pytest.mark.parametrize("model_type,hf,gguf", [
    ("llama", "model.layers.3.self_attn.q_proj.weight", "blk.3.attn_q.weight"),
    ("qwen3", "model.layers.0.mlp.down_proj.weight", "blk.0.ffn_down.weight"),
    ("qwen3_5", "model.language_model.layers.2.linear_attn.out_proj.weight", "blk.2.ssm_out.weight"),
    ("qwen3_5_text", "model.layers.1.linear_attn.in_proj_qkv.weight", "blk.1.attn_qkv.weight"),
    ("qwen3_5", "model.language_model.embed_tokens.weight", "token_embd.weight"),
    ("lfm2", "model.layers.0.conv.in_proj.weight", "blk.0.shortconv.in_proj.weight"),
    ("lfm2", "model.layers.2.feed_forward.w2.weight", "blk.2.ffn_down.weight"),
])
def test_gguf_names(model_type, hf, gguf):
    assert get_adapter(model_type).gguf_name(hf) == gguf


def test_attention_family():
    q = get_adapter("qwen3_5")
    assert q.is_attention("model.layers.0.linear_attn.in_proj_z.weight")
    assert q.is_attention("model.layers.3.self_attn.q_proj.weight")
    assert not q.is_attention("model.layers.3.mlp.up_proj.weight")
    assert get_adapter("lfm2").transpose_embedding is False  # verified against conversion/lfm2.py
