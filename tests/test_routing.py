"""Per-token routing (PTQR) and straight-through Gumbel on a tiny random Llama."""

import pytest
import torch
import torch.nn.functional as F
from torch.nn.utils import parametrize

from voodoo_quant.experimental import routing
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.trainer import Trainer

MENU = ("Q8_0", "Q4_K", "Q2_K")


@pytest.fixture(scope="module")
def student_run(gate_model_dir, tmp_path_factory):
    out = tmp_path_factory.mktemp("routing_run")
    cfg = TrainConfig(model=str(gate_model_dir / "model"), data_dir=str(gate_model_dir / "data"), seq_len=32,
                      batch_size=2, max_steps=2, compression_ratio=0.6, candidate_types=MENU, output_dir=str(out))
    return Trainer(cfg).prepare()


def _set_one_hot(run, gap: float = 60.0) -> dict[str, int]:
    """Gates with every tensor on one rung: p = (1, ~1e-27, ...) in float32, so the soft mixture
    is exactly that rung's weight, yet the softmax still passes a (tiny) non-zero gradient."""
    g = torch.Generator().manual_seed(5)
    pick = {}
    with torch.no_grad():
        for n, mq in run.mixed.items():
            k = int(torch.randint(mq.k, (1,), generator=g))
            mq.gates.fill_(-gap)
            mq.gates[k] = 0.0
            mq.tau = 1.0
            mq.unbake()
            pick[n] = k
    return pick


def _loss(run, ids, router=None):
    for mq in run.mixed.values():
        if mq.gates.grad is not None:
            mq.gates.grad = None
    with routing.routed(run.student, router):
        with parametrize.cached():
            logits = run.student(input_ids=ids).logits
        loss = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), ids[:, 1:].reshape(-1))
        loss.backward()
    return logits.detach(), {n: mq.gates.grad.clone() for n, mq in run.mixed.items()}


def test_ptqr_with_one_hot_gates_is_the_baked_model_and_keeps_the_soft_gate_gradient(student_run):
    run = student_run
    ids = run.tokens[:2]
    pick = _set_one_hot(run)
    soft_logits, soft_grads = _loss(run, ids)
    ptqr_logits, ptqr_grads = _loss(run, ids, routing.Router("ptqr", seed=0, step=3))
    for n, mq in run.mixed.items():
        mq.bake(pick[n])
    try:
        with torch.no_grad():
            baked = run.student(input_ids=ids).logits
    finally:
        for mq in run.mixed.values():
            mq.unbake()
    assert torch.equal(ptqr_logits, baked)
    assert torch.equal(soft_logits, baked)
    nonzero = 0
    uses = [m for _, m in run.student.named_modules(remove_duplicate=False)]
    tied = {n for n, mq in run.mixed.items() if sum(m is mq for m in uses) > 1}
    assert tied == {"model.embed_tokens.weight"}
    for n in run.mixed:
        # A tied embedding / head: the soft step mixes it once and dots the sum of both uses'
        # gradients (layers.cached), the routed one dots each use's: 1.3e-4 apart measured. The
        # others are float32 sums in another order: up to 5e-5 apart at 2 threads and 1.3e-4 at one
        # (measured on the compensated candidates of the default).
        rtol = 1e-3 if n in tied else 3e-4
        torch.testing.assert_close(ptqr_grads[n], soft_grads[n], rtol=rtol, atol=0.0, msg=n)
        nonzero += int((soft_grads[n] != 0).any())
    assert nonzero == len(run.mixed)  # the comparison is not between zeros
    # The swap is undone: the model is its plain parametrized self again.
    assert not any(isinstance(m, routing.RoutedModule) for m in run.student.modules())


def test_routed_linear_gradient_matches_the_mixture_formula_for_any_gates():
    torch.manual_seed(0)
    cands = torch.randn(3, 5, 7)
    x = torch.randn(4, 6, 7, requires_grad=True)
    from voodoo_quant.student.layers import MixedQuant

    mq = MixedQuant("w", ("A", "B", "C"), (1, 2, 3), cands, (5, 7))
    p = torch.tensor([0.2, 0.5, 0.3], requires_grad=True)
    routes = torch.randint(0, 3, (24,))
    y = routing._RoutedLinear.apply(x, p, routes, mq, None)
    gy = torch.randn_like(y)
    y.backward(gy)
    # Forward: each token through its own candidate.
    ref = torch.stack([x.detach().reshape(24, 7)[i] @ cands[routes[i]].t() for i in range(24)]).reshape(4, 6, 5)
    torch.testing.assert_close(y.detach(), ref)
    # Gate gradient: <Σ_i g_i x_iᵀ, W_k>, the soft mixture's dL/dp_k for the same activations.
    gw = gy.reshape(24, 5).t() @ x.detach().reshape(24, 7)
    torch.testing.assert_close(p.grad, torch.stack([(gw * cands[k]).sum() for k in range(3)]))
    # Input gradient: through the candidate each token used.
    gx = torch.stack([gy.reshape(24, 5)[i] @ cands[routes[i]] for i in range(24)]).reshape(4, 6, 7)
    torch.testing.assert_close(x.grad, gx)


def test_routes_follow_the_gate_probabilities_and_are_a_function_of_the_seed():
    p = torch.tensor([0.1, 0.6, 0.3])
    r = routing.sample_routes(p, 20000, seed=11)
    freq = torch.bincount(r, minlength=3).float() / r.numel()
    torch.testing.assert_close(freq, p, atol=0.015, rtol=0.0)
    assert torch.equal(r, routing.sample_routes(p, 20000, seed=11))
    assert not torch.equal(r, routing.sample_routes(p, 20000, seed=12))
    # A zero-probability rung is never drawn.
    assert (routing.sample_routes(torch.tensor([0.0, 1.0, 0.0]), 1000, seed=1) == 1).all()


def test_st_gumbel_is_one_hot_forward_with_a_soft_gradient():
    g = torch.tensor([0.3, -0.2, 0.1], requires_grad=True)
    p = torch.softmax(g, 0)
    y = routing.st_gumbel_probs(p, 0.5, seed=4)
    assert sorted(y.detach().tolist()) == [0.0, 0.0, 1.0]
    (y * torch.tensor([1.0, 2.0, 3.0])).sum().backward()
    assert g.grad is not None and g.grad.abs().sum() > 0


def test_ptqr_and_st_gumbel_train_and_bake(gate_model_dir, tmp_path):
    """Started far over budget (every gate leaning to Q8_0), the gates trained under routing must
    pull the size back by themselves: where the argmax lands before repair and fill (which
    guarantee the baked size whatever the gates do) is checked, not only the baked size.
    Measured (8 steps): the argmax goes from +67 % to -11.8 % of the target under both modes (an
    overshoot that τ annealing then freezes; fill brings it into the zone); with the size penalty
    off (size_weight 0) it ends at +59 % / +61 %."""
    for kw in ({"ptqr": True}, {"st_gumbel_fraction": 0.5}):
        cfg = TrainConfig(model=str(gate_model_dir / "model"), data_dir=str(gate_model_dir / "data"), seq_len=32,
                          batch_size=2, max_steps=8, compression_ratio=0.6, candidate_types=MENU,
                          output_dir=str(tmp_path / next(iter(kw))), polish=False, **kw)
        tr = Trainer(cfg)
        run = tr.prepare()
        with torch.no_grad():
            for mq in run.mixed.values():
                mq.gates.copy_(torch.tensor([0.0, 0.0, 1.0]))  # menus are cheapest first: Q8_0 everywhere, 1.67x the target
        b = run.budget
        start = sum(p.sizes[-1] for p in run.plans)
        assert start > 1.5 * b.train_target_bytes
        res = tr.train()
        assert len(res.history) == 8 and all(m.kl == m.kl for m in res.history)  # finite, not NaN
        assert b.target_bytes * (1 - b.tolerance) <= res.assignment.total_bytes <= b.upper_bytes
        arg = sum(p.sizes[res.bake.argmax[p.name]] for p in run.plans)
        assert abs(arg / b.train_target_bytes - 1) <= 0.15, (kw, arg, b.train_target_bytes)
