"""MixedQuant: gradients, one-hot == baked, lazy == eager, tied embeddings, expected size."""

import numpy as np
import pytest
import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from voodoo_quant.arch import adapter_for
from voodoo_quant.selection.menus import MenuConfig
from voodoo_quant.student.build import attach_all, build_mixed, candidate_bytes, plan_model
from voodoo_quant.student.layers import MixedQuant, attach, mixed_modules

MENU = MenuConfig(("Q8_0", "Q4_K", "Q2_K", "Q4_0"))


def _tiny_model(tied=True):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=tied)
    return LlamaForCausalLM(cfg).eval()


def _student(lazy=False, tied=True, dtype=torch.float32, compact=True):
    model = _tiny_model(tied)
    plans = plan_model(model, adapter_for(model.config), MENU)
    from voodoo_quant.student.build import selectable_weights

    w = selectable_weights(model)
    blobs = {p.name: candidate_bytes(p, w[p.name][0], None) for p in plans}
    mixed = {p.name: build_mixed(p, blobs[p.name], lazy=lazy, dtype=dtype, compact=compact) for p in plans}
    attach_all(model, plans, mixed)
    return model, plans, mixed


def test_gate_gradients_match_finite_differences():
    model, plans, mixed = _student(compact=False)  # float64 stacks (the int8 codes: test_compact.py)
    model.double()
    for mq in mixed.values():
        mq.dtype = torch.float64
        mq.stacked = mq.stacked.double()
    ids = torch.randint(0, 128, (1, 12), generator=torch.Generator().manual_seed(0))
    # The tied embedding/head moves the logits most; HF's RMSNorm computes in float32 whatever the
    # model dtype, so the step is 1e-3 and the tolerance 1 %: a wrong gradient (sign, missing p_k factor) is off by far more.
    mq = mixed["model.embed_tokens.weight"]
    with torch.no_grad():
        mq.gates.copy_(torch.tensor([0.3, -0.2, 0.1, 0.0]))

    def loss():
        with parametrize.cached():
            return model(input_ids=ids).logits.double().pow(2).mean()

    model.zero_grad()
    loss().backward()
    analytic = mq.gates.grad.clone()
    eps = 1e-3
    numeric = torch.zeros_like(analytic)
    for k in range(mq.k):
        with torch.no_grad():
            mq.gates[k] += eps
            up = loss().item()
            mq.gates[k] -= 2 * eps
            down = loss().item()
            mq.gates[k] += eps
        numeric[k] = (up - down) / (2 * eps)
    assert torch.allclose(analytic.double(), numeric, rtol=1e-2, atol=1e-6), (analytic, numeric)
    assert analytic.abs().max() > 0


def test_one_hot_gates_equal_baked_output_exactly():
    model, plans, mixed = _student()
    ids = torch.randint(0, 128, (1, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        for i, mq in enumerate(mixed.values()):
            k = i % mq.k
            mq.gates.fill_(-1e4)
            mq.gates[k] = 1e4
        with parametrize.cached():
            soft = model(input_ids=ids).logits
        for mq in mixed.values():
            mq.bake()
        baked = model(input_ids=ids).logits
    assert torch.equal(soft, baked)
    for mq in mixed.values():
        mq.unbake()
        assert mq.baked is None


@pytest.mark.parametrize("compact", [False, True], ids=["float32 stack", "int8 codes"])
def test_lazy_equals_eager_forward_and_gradients(compact):
    """The eager mixture (a float32 stack's product, or the native kernel over int8 codes) is the
    lazy path's sequential sum bit for bit; so are the stack's gate gradients (the same dot
    products), while the kernel's are summed in float64 by chunks: equal to float32 accuracy."""
    e_model, _, e_mixed = _student(lazy=False, compact=compact)
    l_model, _, l_mixed = _student(lazy=True)
    from voodoo_quant.candidates.compact import CompactCandidates

    assert all(isinstance(m._get, CompactCandidates) == compact for m in e_mixed.values())
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    outs = []
    for model, mixed in ((e_model, e_mixed), (l_model, l_mixed)):
        with parametrize.cached():
            y = model(input_ids=ids).logits
        y.square().mean().backward()
        outs.append((y.detach(), {n: m.gates.grad.clone() for n, m in mixed.items()}))
    assert torch.equal(outs[0][0], outs[1][0])
    for n, g in outs[0][1].items():
        if compact:  # each a difference of nearly equal float32 sums: rounding at ~1e-5 of the largest
            torch.testing.assert_close(g, outs[1][1][n], rtol=0, atol=1e-4 * float(g.abs().max()))
        else:
            assert torch.equal(g, outs[1][1][n]), n


def test_cached_mixes_a_tied_gate_set_once(monkeypatch):
    """layers.cached(): the tied embedding / LM head is mixed once per forward (parametrize.cached()
    alone mixes it for each module: 9 mixtures for 8 gate sets), the logits are bit-equal, and
    the tied gates' gradient is the sum of both uses' (equal to float32 rounding)."""
    from voodoo_quant.student import layers

    real, calls = layers._Mix.forward, []

    def counting(ctx, p, get, *args):
        calls.append(get.shape if isinstance(get, torch.Tensor) else None)
        return real(ctx, p, get, *args)

    monkeypatch.setattr(layers._Mix, "forward", staticmethod(counting))
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(2))
    got = {}
    for name, ctx in (("each module", parametrize.cached), ("once", layers.cached)):
        model, plans, mixed = _student(tied=True)
        calls.clear()
        with ctx():
            y = model(input_ids=ids).logits
        y.square().mean().backward()
        got[name] = (len(calls), y.detach(), {n: m.gates.grad.clone() for n, m in mixed.items()})
    assert len(plans) == 8 and got["each module"][0] == 9 and got["once"][0] == 8
    assert torch.equal(got["each module"][1], got["once"][1])
    for n, g in got["once"][2].items():
        # One float32 dot product per candidate of the summed gradient instead of one per use; a gate
        # gradient is a difference of such nearly equal products, so the rounding shows at ~1e-5 of
        # the largest. A use left out would be off by the order of the gradient itself.
        torch.testing.assert_close(g, got["each module"][2][n], rtol=0, atol=1e-4 * float(g.abs().max()))
    assert layers._shared is None  # the memo ends with the context


def test_tied_embedding_is_one_gate_set_and_expected_size_matches_bytes():
    model, plans, mixed = _student(tied=True)
    names = [p.name for p in plans]
    assert "model.embed_tokens.weight" in names and "lm_head.weight" not in names
    emb = mixed["model.embed_tokens.weight"]
    assert model.lm_head.parametrizations.weight[0] is emb
    assert len(mixed_modules(model)) == len(plans)
    gate_params = [n for n, _ in model.named_parameters() if n.endswith("gates")]
    assert len(gate_params) == len(plans)
    # One-hot expected size is exactly the chosen candidates' GGUF bytes.
    total = 0
    with torch.no_grad():
        for p in plans:
            mq = mixed[p.name]
            mq.gates.fill_(-1e4)
            mq.gates[1] = 1e4
            total += p.sizes[1]
    assert float(sum(m.expected_bytes().detach() for m in mixed.values())) == total


def test_untied_model_has_separate_head():
    _, plans, _ = _student(tied=False)
    assert {"model.embed_tokens.weight", "lm_head.weight"} <= {p.name for p in plans}


def test_mixed_quant_validates_shapes():
    with pytest.raises(ValueError):
        MixedQuant("x", ["Q8_0"], [1, 2], torch.zeros(1, 2, 2), (2, 2))
    with pytest.raises(ValueError):
        MixedQuant("x", ["Q8_0"], [1], torch.zeros(2, 2, 2), (2, 2))
    lin = nn.Linear(4, 2)
    mq = MixedQuant("x", ["A"], [1], torch.ones(1, 2, 4), (2, 4))
    attach(lin, mq)
    with pytest.raises(ValueError):
        attach(lin, MixedQuant("x", ["A"], [1], torch.ones(1, 2, 4), (2, 4)))
    assert np.isclose(mq.confidence(), 1.0)


def test_mix_buffers_are_bit_equal_to_fresh_mixtures_and_reused_across_steps():
    """layers.cached(buffers): the same logits and gate gradients, bit for bit, as fresh mixtures,
    step after step with moving gates; every gate set writes into one tensor kept across steps
    (the tied embedding / LM head one, not two); clear() drops them."""
    from voodoo_quant.student import layers

    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(3))
    fresh_model, _, fresh = _student(tied=True)
    kept_model, _, kept = _student(tied=True)
    buffers = layers.MixBuffers()
    ptrs = []
    for step in range(3):
        outs = []
        for model, mixed, ctx in ((fresh_model, fresh, layers.cached()), (kept_model, kept, layers.cached(buffers))):
            with torch.no_grad():
                for i, n in enumerate(sorted(mixed)):
                    mixed[n].gates.copy_(torch.randn(mixed[n].k, generator=torch.Generator().manual_seed(100 * step + i)))
            model.zero_grad(set_to_none=True)
            with ctx:
                y = model(input_ids=ids).logits
                if model is kept_model:
                    ptrs.append(model.model.embed_tokens.weight.data_ptr())
            y.square().mean().backward()
            outs.append((y.detach(), {n: m.gates.grad.clone() for n, m in mixed.items()}))
        assert torch.equal(outs[0][0], outs[1][0]), step
        for n in outs[0][1]:
            assert torch.equal(outs[0][1][n], outs[1][1][n]), (step, n)
    assert len(buffers._out) == len(kept) == 8  # one per gate set: the tied pair shares one
    assert len(set(ptrs)) == 1  # the embedding's mixture lands in the same memory every step
    assert buffers.nbytes == sum(int(np.prod(m.shape)) * 4 for m in kept.values())
    assert layers._buffers is None  # the context ends, the module forgets the store
    buffers.clear()
    assert buffers.nbytes == 0
    # A bf16 student's mixtures are cast from the float32 product: nothing to keep, nothing held.
    _, _, bf16 = _student(tied=True, dtype=torch.bfloat16)
    with layers.cached(buffers):
        ws = [mq(torch.empty(0)) for mq in bf16.values()]
    assert all(w.dtype == torch.bfloat16 for w in ws) and buffers.nbytes == 0


def test_mix_buffer_rewritten_while_autograd_holds_it_raises():
    """The one misuse of MixBuffers (mixing again before the previous mixture's backward) is loud:
    the write bumps the buffer's version counter and the pending backward refuses."""
    from voodoo_quant.student import layers

    model, _, mixed = _student(tied=True)
    ids = torch.randint(0, 128, (1, 8), generator=torch.Generator().manual_seed(4))
    buffers = layers.MixBuffers()
    with layers.cached(buffers):
        first = model(input_ids=ids).logits.square().mean()
    with torch.no_grad():
        for m in mixed.values():
            m.gates.add_(1.0 + torch.arange(m.k, dtype=m.gates.dtype))
    with layers.cached(buffers):
        model(input_ids=ids).logits  # mixes again into the same buffers
    with pytest.raises(RuntimeError, match="modified inplace|modified by an inplace operation"):
        first.backward()
