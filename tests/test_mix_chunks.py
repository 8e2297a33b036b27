"""Chunked mixing: a weight larger than ``layers.MIX_CHUNK_ELEMENTS`` is mixed a block of rows at a
time, reading only those rows of each candidate, so the mixing transient is a block, not the
tensor (the 27B recipe's 62080 x 5120 vocabulary shards). The mixture is bit-identical to the
unchunked one; the gate gradient sums the same dot products block by block, so it agrees to
float32 rounding (a relative 1e-5 of the largest component; a wrong block, row or candidate is
off by far more)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from voodoo_quant.arch import adapter_for
from voodoo_quant.selection.menus import MenuConfig
from voodoo_quant.student.build import build_mixed, candidate_bytes, direct_quantize, plan_model, selectable_weights
from voodoo_quant.student.layers import _Mix, row_reader

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
MENU = MenuConfig(("Q8_0", "Q4_K", "Q2_K", "Q4_0"))
LIMIT = 256 * 7  # 7 rows of 256 per block: blocks of 7 rows plus a shorter last block


class Counting:
    """A candidate source that counts how it is read: whole candidates vs blocks of rows."""

    def __init__(self, inner):
        self.inner, self.whole, self.blocks = inner, 0, []

    @property
    def shape(self):
        return tuple(self.inner.shape[1:]) if isinstance(self.inner, torch.Tensor) else self.inner.shape

    def __call__(self, k):
        self.whole += 1
        return self.inner[k] if isinstance(self.inner, torch.Tensor) else self.inner(k)

    @property
    def row_reader(self):
        read = row_reader(self.inner)
        if read is None:
            return None

        def rows(k, lo, hi):
            self.blocks.append(hi - lo)
            return read(k, lo, hi)
        return rows


def _upstream(shape, dtype):
    return torch.randn(shape, generator=torch.Generator().manual_seed(3)).to(dtype)


def _mix_and_grad(p0, src, k, dtype, limit):
    p = p0.clone().requires_grad_(True)
    w = _Mix.apply(p, src, k, dtype, limit)
    (w.float() * _upstream(w.shape, dtype).float()).sum().backward()
    return w.detach(), p.grad


def _check(src_whole, src_chunked, k, dtype):
    """Same mixture bits; each gate gradient <G, W_k> within float32 summation error of the exact
    (float64) dot product, for both paths: |err| <= 1e-5 * Σ_i |G_i W_k,i|."""
    p0 = torch.softmax(torch.tensor([0.3, -0.2, 0.1, 0.05][:k]), 0)
    w1, g1 = _mix_and_grad(p0, src_whole, k, dtype, None)
    w2, g2 = _mix_and_grad(p0, src_chunked, k, dtype, LIMIT)
    assert torch.equal(w1, w2)  # every element by the same operations
    up = _upstream(w1.shape, dtype).double()
    for j in range(k):
        wk = (src_whole[j] if isinstance(src_whole, torch.Tensor) else src_whole(j)).double()
        exact, scale = float((up * wk).sum()), float((up * wk).abs().sum())
        for g in (g1, g2):
            assert abs(float(g[j]) - exact) <= 1e-5 * scale, (j, float(g[j]), exact, scale)
    return g1, g2


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=200, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("lazy,dtype", [(True, torch.bfloat16), (False, torch.float32), (False, torch.bfloat16)])
def test_chunked_mixture_equals_the_whole_one(lazy, dtype, ggml_lib):
    model = _tiny()
    plans = plan_model(model, adapter_for(model.config), MENU)
    w = selectable_weights(model)
    chunked = 0
    for p in plans:
        # float32 stacks (int8 codes are mixed whole, with no transient: test_compact.py)
        mq = build_mixed(p, candidate_bytes(p, w[p.name][0], None), lazy=lazy, dtype=dtype, compact=False)
        src = mq.stacked if mq.stacked is not None else mq._get
        counted = Counting(src)
        # Read through a wrapper, a float32 stack is mixed candidate by candidate (the lazy path)
        # whole and by blocks; the stack itself by one matrix-vector product, whole and by blocks
        # (the eager path, whose BLAS may fuse the multiply-add: its bits may differ from the loop's).
        _check(Counting(src) if isinstance(src, torch.Tensor) else src, counted, mq.k, dtype)
        if isinstance(src, torch.Tensor):
            _check(src, src, mq.k, dtype)
        if p.shape[0] * p.shape[1] > LIMIT:
            assert counted.whole == 0 and counted.blocks and max(counted.blocks) <= LIMIT // p.shape[1], p.name
            chunked += 1
    assert chunked == len(plans)


def test_vocabulary_shards_are_mixed_by_rows(tmp_path_factory, ggml_lib):
    """Under tensor parallelism with the converter's layouts, the embedding and LM head shards
    (and every whole-row shard) read blocks of rows from their packed bytes."""
    from tp_case import build_models, config

    from voodoo_quant.distributed.parallel import plan_tp
    from voodoo_quant.student.build import ShardedPacked
    from voodoo_quant.training.models import load_models
    from voodoo_quant.training.setup import plan_run

    d = build_models(tmp_path_factory.mktemp("chunks"), ("qwen3",))["qwen3"]
    cfg = config(d, d / "unused", 2)
    base, _ = load_models(cfg, torch.float32)
    adapter, plans, _ = plan_run(cfg, base)
    tp_plan = plan_tp(base, adapter, 2, plans)
    weights = {n: w for n, (w, _) in selectable_weights(base).items()}
    vocab = {"model.embed_tokens.weight", "lm_head.weight"}
    seen = set()
    for p in plans:
        sh = tp_plan.shard_of(p.name)
        blobs = candidate_bytes(p, weights[p.name], {}, direct_quantize)
        if sh is None:
            continue
        for r in range(2):
            sp = ShardedPacked.build(p, blobs, sh, r, 2, "cpu", torch.float32)
            if sp.full_fallback:
                assert row_reader(sp) is None
                continue
            counted = Counting(sp)
            _check(sp, counted, len(blobs), torch.float32)
            if sp.shape[0] * sp.shape[1] > LIMIT:
                assert counted.whole == 0 and counted.blocks, (p.name, r)
            seen.add(p.name)
    assert vocab <= seen
