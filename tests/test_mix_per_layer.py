"""Under --gradient_checkpointing a step mixes each layer's weights when the layer runs (and again
when the checkpoint recomputes it in backward) instead of caching every layer's mixture for the
whole step: only one layer's mixed weights live at a time, and the gate gradients are the same."""

from __future__ import annotations

import sys
import weakref
from pathlib import Path

import pytest
import torch

from voodoo_quant.student.layers import mixed_modules

sys.path.insert(0, str(Path(__file__).parent / "helpers"))


@pytest.fixture(scope="module")
def untied_dir(tmp_path_factory):
    from tp_case import build_models

    return build_models(tmp_path_factory.mktemp("perlayer"), ("qwen3",))["qwen3"]  # untied embedding / head


def _prepared(d, out, lazy=True):
    from tp_case import config

    from voodoo_quant.training.trainer import Trainer

    tr = Trainer(config(d, out, 1, gradient_checkpointing=True, lazy=lazy, warm_start=False, polish=False,
                        max_steps=2))
    return tr.prepare()


def _grads_and_live(run, per_layer: bool):
    """Gate gradients of one micro-batch, and the most mixed weights alive at any moment."""
    from voodoo_quant.training.trainer import micro_backward

    live: list[weakref.ref] = []
    most = [0]

    def hook(mod, args, out):
        live.append(weakref.ref(out))
        most[0] = max(most[0], sum(r() is not None for r in live))

    mixed = mixed_modules(run.student)
    handles = [mq.register_forward_hook(hook) for mq in mixed.values()]
    for mq in mixed.values():
        mq.gates.grad = None
    ids = run.tokens[:2].to(run.device)
    try:
        micro_backward(run, ids, None, 1, per_layer=per_layer)
    finally:
        for h in handles:
            h.remove()
    return {n: mq.gates.grad.clone() for n, mq in mixed.items()}, most[0], len(live)


@pytest.mark.parametrize("lazy", [True, False])
def test_same_gate_gradients_one_layer_alive(untied_dir, tmp_path, lazy, ggml_lib):
    from voodoo_quant.training.trainer import mixes_per_layer

    run = _prepared(untied_dir, tmp_path, lazy=lazy)
    assert mixes_per_layer(run, None)  # the trainer's own choice under --gradient_checkpointing
    cached, most_cached, calls_cached = _grads_and_live(run, per_layer=False)
    per_layer, most_per_layer, calls_per_layer = _grads_and_live(run, per_layer=True)
    n = len(cached)
    per_layer_weights = 7  # q k v o gate up down of one decoder layer
    assert most_cached == n  # the step-long cache: every mixture at once
    assert most_per_layer <= per_layer_weights + 1  # one layer's (+ the head's, alive through the loss)
    assert calls_per_layer == calls_cached  # both recompute the checkpointed layers' mixtures in backward
    for name in cached:  # untied: every mixture has one use, the recompute gives the same bits
        assert torch.equal(cached[name], per_layer[name]), name


def test_tied_embedding_gradients_agree(gate_model_dir, tmp_path, ggml_lib):
    """Mixed per layer, a tied embedding / head is mixed once per use and its two gradient
    contributions are summed after the dot products; in the step-long cache (layers.cached) it is
    mixed once and they are summed before (<g1, W_k> + <g2, W_k> vs <g1 + g2, W_k>). So its gate
    gradient agrees to the float32 rounding of those products; every other tensor is bitwise
    equal."""
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    cfg = TrainConfig(model=str(gate_model_dir / "model"), data_dir=str(gate_model_dir / "data"), seq_len=32,
                      batch_size=2, max_steps=2, compression_ratio=0.62, candidate_types=("Q8_0", "Q4_0"),
                      output_dir=str(tmp_path), lazy=True, gradient_checkpointing=True, warm_start=False,
                      polish=False, loss_chunk_size=16)
    run = Trainer(cfg).prepare()
    cached, _, _ = _grads_and_live(run, per_layer=False)
    per_layer, _, _ = _grads_and_live(run, per_layer=True)
    tied = "model.embed_tokens.weight"
    assert tied in cached
    for name in cached:
        if name == tied:
            # A gate gradient is a difference of nearly equal dot products (the softmax Jacobian),
            # so their rounding shows at a few % of this tiny model's gradients; a use left out or
            # counted twice would be off by the tied gradient itself, which is well above that.
            tol = 0.05 * max(float(g.abs().max()) for g in cached.values())
            assert float(cached[name].abs().max()) > 3 * tol
            assert torch.allclose(cached[name], per_layer[name], rtol=0, atol=tol), name
        else:
            assert torch.equal(cached[name], per_layer[name]), name
