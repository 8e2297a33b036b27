"""Chunked CE/KL equal the whole-logit losses and their gate gradients."""

import json

import pytest
import torch
from torch.nn.utils import parametrize

from voodoo_quant.experimental import routing
from voodoo_quant.training import losses
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.trainer import Trainer

MENU = ("Q8_0", "Q4_K", "Q2_K")


def _cfg(d, out, **kw):
    base = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=2,
                compression_ratio=0.6, candidate_types=MENU, output_dir=str(out))
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def run(gate_model_dir, tmp_path_factory):
    r = Trainer(_cfg(gate_model_dir, tmp_path_factory.mktemp("losses_run"))).prepare()
    with torch.no_grad():  # distinct, non-uniform gates so every rung matters
        g = torch.Generator().manual_seed(2)
        for mq in r.mixed.values():
            mq.gates.copy_(torch.randn(mq.k, generator=g))
    return r


def _terms(run, ids, chunk, router=None):
    for mq in run.mixed.values():
        mq.gates.grad = None
    with routing.routed(run.student, router):
        with parametrize.cached():
            ce, kl = losses.distill_terms(run.student, run.teacher, ids, chunk_tokens=chunk, router=router)
        (ce + 0.7 * kl).backward()
    return float(ce.detach()), float(kl.detach()), {n: mq.gates.grad.clone() for n, mq in run.mixed.items()}


@pytest.mark.parametrize("chunk", [7, 16, 61])
def test_chunked_losses_and_gradients_equal_the_whole_logits(run, chunk):
    assert losses.chunk_reason(run.student) is None
    ids = run.tokens[:2]  # 2 × 31 = 62 predicted tokens: 62 > chunk, so the chunked path runs
    ce0, kl0, g0 = _terms(run, ids, 0)
    ce1, kl1, g1 = _terms(run, ids, chunk)
    assert kl0 > 1e-4  # a real distillation signal, not a trivially equal zero
    assert ce1 == pytest.approx(ce0, rel=1e-6)
    assert kl1 == pytest.approx(kl0, rel=1e-5)
    for n in g0:
        torch.testing.assert_close(g1[n], g0[n], rtol=1e-4, atol=1e-7)


def test_chunked_routed_head_is_reproducible_under_the_checkpoint(run, monkeypatch):
    """PTQR draws the LM head's routes per chunk (salted); the backward pass recomputes each chunk
    inside its gradient checkpoint and must see the same routes as the forward did. Reference: the
    same chunks and salts without the checkpoint (autograd keeps the forward's own graph), so the
    gradients must be equal; a recompute with other routes gives other gradients."""
    ids = run.tokens[2:4]
    router = routing.Router("ptqr", 0, 5)
    ck = _terms(run, ids, 16, router)
    monkeypatch.setattr(losses, "checkpoint", lambda fn, *a, use_reentrant=False: fn(*a))
    ref = _terms(run, ids, 16, router)
    monkeypatch.undo()
    assert ck[0] == ref[0] and ck[1] == ref[1]
    head = run.mixed[next(n for n in run.mixed if "embed_tokens" in n)]  # tied: the LM head's gates
    assert ref[2][head.name].abs().sum() > 0
    for n in ref[2]:
        torch.testing.assert_close(ck[2][n], ref[2][n], rtol=1e-5, atol=1e-8, msg=lambda m, n=n: f"{n}: {m}")
    # The routes really depend on the chunk salt (else the test could not tell a wrong recompute,
    # and every chunk of the head would draw the same routes).
    p = head.probs().detach()
    draws = []
    for salt in (0, 1, 2):
        router.salt = salt
        draws.append(routing.sample_routes(p, 64, router.key(head.name, "lm_head")))
    router.salt = 0
    assert not torch.equal(draws[0], draws[1]) and not torch.equal(draws[1], draws[2])


def test_logit_transforms_fall_back_to_whole_logits(run):
    class Cfg:
        final_logit_softcapping = 30.0

    class Fake(torch.nn.Module):
        base_model_prefix = "model"
        config = Cfg()

        def __init__(self):
            super().__init__()
            self.model = torch.nn.Identity()
            self.lm_head = torch.nn.Linear(2, 3)

        def get_output_embeddings(self):
            return self.lm_head

    assert "final_logit_softcapping" in losses.chunk_reason(Fake())


def test_grad_accum_log_file_teacher_device_and_finalize(gate_model_dir, tmp_path):
    log = tmp_path / "logs" / "run.jsonl"
    cfg = _cfg(gate_model_dir, tmp_path / "a", max_steps=3, grad_accum_steps=2, loss_chunk_size=16,
               teacher_device="cpu", log_file=str(log), partial_save_interval=1,
               guarantee=False, search_evals=0)  # finalize redoes the bake only: compare it with a bake
    res = Trainer(cfg).train()
    lines = [json.loads(x) for x in log.read_text().splitlines()]
    assert [ln["step"] for ln in lines] == [1, 2, 3]
    for key in ("loss", "ce", "kl", "size_penalty", "expected_bytes", "tau", "gate_entropy", "tokens_per_s",
                "memory_bytes"):
        assert key in lines[0], key
    assert lines[0]["memory_bytes"] > 0
    # Two micro-batches of 2 sequences × 32 tokens per step.
    assert res.history[0].tokens_per_s > 0
    # Redo only the bake from the journal: the same assignment, no training.
    fin = Trainer(_cfg(gate_model_dir, tmp_path / "b", max_steps=3, grad_accum_steps=2,
                       finalize_from_partial=str(tmp_path / "a" / "partial.pt"))).train()
    assert fin.assignment.to_dict()["tensors"] == res.assignment.to_dict()["tensors"]
    assert fin.resumed_from == 3
