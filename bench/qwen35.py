"""A random Qwen3.5-shaped checkpoint for the benches (the hybrid of the reference recipe: three
Gated DeltaNet layers per full-attention layer, 128-wide heads, tied embeddings), shared by
bench/memory_model.py, bench/tp_memory.py and bench/gpu_train_check.py.

Heads scale with the width (hidden / 128 query and value heads, a quarter of them KV heads, half
of them DeltaNet key heads, never fewer than two, so a 2-rank tensor-parallel split works).
"""

from __future__ import annotations

from pathlib import Path


def qwen35_config(hidden: int, layers: int, vocab: int, *, max_positions: int = 8192):
    """The ``Qwen3_5TextConfig`` of a hidden-`hidden`, `layers`-layer model (layers a multiple of 4)."""
    import transformers as T

    if layers % 4:
        raise ValueError(f"a Qwen3.5-shaped model has 3 DeltaNet layers per attention layer: {layers} is not a multiple of 4")
    heads = hidden // 128
    return T.Qwen3_5TextConfig(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=max(2, heads // 4), head_dim=128,
        linear_num_key_heads=max(2, heads // 2), linear_num_value_heads=heads, linear_key_head_dim=128,
        linear_value_head_dim=128, layer_types=(["linear_attention"] * 3 + ["full_attention"]) * (layers // 4),
        tie_word_embeddings=True, max_position_embeddings=max_positions)


def save_qwen35(d: Path, hidden: int, layers: int, vocab: int, *, max_positions: int = 8192, dtype=None,
                seed: int = 0) -> int:
    """Save a random model of that shape to `d` (``save_pretrained``); returns its parameter count."""
    import torch
    import transformers as T

    torch.manual_seed(seed)
    m = T.Qwen3_5ForCausalLM(qwen35_config(hidden, layers, vocab, max_positions=max_positions))
    if dtype is not None:
        m = m.to(dtype)
    n = sum(p.numel() for p in m.parameters())
    m.save_pretrained(d)
    return n


def save_tokens(d: Path, vocab: int, n: int, seq: int, seed: int = 1) -> Path:
    """A ``train_tokens.pt`` of `n` random sequences in `d` (speed and memory only: no text)."""
    import torch

    d.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(seed)
    torch.save(torch.randint(0, vocab, (n, seq), generator=g), d / "train_tokens.pt")
    return d / "train_tokens.pt"
