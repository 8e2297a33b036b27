"""Architecture registry and the shipped adapters (pure data; no model needed)."""

from __future__ import annotations

import pytest

from voodoo_quant.arch import GenericAdapter, adapter_for, get_adapter, known_adapters, register
from voodoo_quant.arch.base import ArchAdapter, UnknownArchitectureError


def test_shipped_adapters_registered():
    assert {"llama", "qwen2", "qwen3", "qwen3_5", "qwen3_5_text", "lfm2"} <= set(known_adapters())


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
    ("qwen2", "model.layers.3.self_attn.k_proj.weight", "blk.3.attn_k.weight"),
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


def test_converter_layout_finds_a_transposition_and_lfm2_embedding_is_not_one(tmp_path):
    """Adapters carry no layout flags: the layout map learns from the converter where each element
    goes. A transposed store is found as such (and maps back exactly), and LFM2's token_embd is
    stored untransposed ([vocab, hidden], conversion/lfm2.py), which the learned map says."""
    import numpy as np
    import torch
    import transformers as T

    from voodoo_quant.gguf.layout import TensorLayout, _factor, model_layouts

    w = np.arange(15, dtype=np.int64).reshape(3, 5)
    fac = _factor(w.T.reshape(-1), (3, 5), (5, 3))
    assert fac == {"rows": None, "cols": None, "transposed": True}
    lay = TensorLayout("w", "w", (3, 5), (5, 3), **fac)
    x = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    assert np.array_equal(lay.to_gguf(x), x.T) and np.array_equal(lay.from_gguf(lay.to_gguf(x)), x)

    torch.manual_seed(0)
    m = T.Lfm2ForCausalLM(T.Lfm2Config(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, tie_word_embeddings=True,
                                       layer_types=["conv", "full_attention"]))
    m.save_pretrained(tmp_path / "lfm2")
    emb = model_layouts(tmp_path / "lfm2")["model.embed_tokens.weight"]
    assert emb.gguf_name == "token_embd.weight" and emb.gguf_shape == (512, 256)
    assert emb.is_identity and not emb.transposed
