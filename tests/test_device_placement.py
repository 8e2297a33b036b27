"""Device-clean training without a GPU: the `meta` device stands in for CUDA.

Autograd refuses a gradient on another device than its parameter ("expected device cpu but got
meta") with the same check a CUDA run trips, so building the student on `meta` and running one
backward shows every gate, buffer and candidate that would be left on the CPU.
"""

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from voodoo_quant.arch import adapter_for
from voodoo_quant.selection.menus import MenuConfig
from voodoo_quant.student.build import attach_all, build_mixed, candidate_bytes, plan_model, selectable_weights
from voodoo_quant.student.layers import MixedQuant, attach

MENU = MenuConfig(("Q8_0", "Q4_K", "Q2_K", "Q4_0"))
META = torch.device("meta")


def _tiny():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64, tie_word_embeddings=True)
    return LlamaForCausalLM(cfg).eval()


def _placed(mq: MixedQuant, device: torch.device) -> None:
    assert mq.gates.device == device, (mq.name, mq.gates.device)
    assert mq.nbytes.device == device, (mq.name, mq.nbytes.device)


def test_mixed_quant_on_meta_runs_backward():
    """Dense candidates and input on `meta`: the gates must follow (today: CPU gates, rejected)."""
    lin = nn.Linear(64, 32, bias=False, device=META)
    cands = torch.randn(3, 32, 64, device=META)
    mq = MixedQuant("w", ("Q8_0", "Q4_K", "Q2_K"), (100, 60, 30), cands, (32, 64))
    attach(lin, mq)
    x = torch.randn(5, 64, device=META)
    with parametrize.cached():
        lin(x).sum().backward()  # before: "_MixBackward returned an invalid gradient ... expected device cpu"
    _placed(mq, META)
    assert mq.gates.grad is not None and mq.gates.grad.device == META
    assert mq.expected_bytes().device == META


def test_mixed_quant_lazy_candidates_take_their_device():
    """A callable (lazy) candidate source has no `.device`: `device=` places the gates."""
    mq = MixedQuant("w", ("Q8_0", "Q4_0"), (10, 5), lambda k: torch.zeros(4, 32, device=META), (4, 32), device=META)
    _placed(mq, META)
    mq2 = MixedQuant("w", ("Q8_0", "Q4_0"), (10, 5), torch.zeros(2, 4, 32, device=META), (4, 32),
                     init_logits=torch.tensor([0.5, -0.5]))
    _placed(mq2, META)


def test_student_built_on_meta_backward(ggml_lib):
    """The trainer's path: real candidates built on the CPU, the student moved to `meta`
    (eager and lazy), one forward and backward through every gate."""
    for lazy in (False, True):
        model = _tiny()
        plans = plan_model(model, adapter_for(model.config), MENU)
        w = selectable_weights(model)
        blobs = {p.name: candidate_bytes(p, w[p.name][0], None) for p in plans}
        model.to(META)
        mixed = {p.name: build_mixed(p, blobs[p.name], lazy=lazy, dtype=torch.float32, device=META) for p in plans}
        attach_all(model, plans, mixed)
        for mq in mixed.values():
            _placed(mq, META)
        ids = torch.zeros(1, 8, dtype=torch.long, device=META)
        with parametrize.cached():
            model(input_ids=ids).logits.float().pow(2).mean().backward()
        for mq in mixed.values():
            assert mq.gates.grad is not None and mq.gates.grad.device == META, mq.name


def test_journal_saves_cpu_and_loads_to_device(tmp_path):
    """The journal holds CPU tensors only (a CUDA tensor in it would pin a GPU at load) and the
    gates and optimizer state go back to the gates' device when resumed."""
    from voodoo_quant.training import journal

    path = tmp_path / "partial.pt"
    real = nn.Parameter(torch.zeros(3))
    opt2 = torch.optim.Adam([real], lr=0.1)
    real.grad = torch.ones(3)
    opt2.step()
    journal.save(path, journal.JournalState(1, {"w": real}, opt2.state_dict(), torch.get_rng_state(), "h", {}))
    raw = torch.load(path, weights_only=True)
    assert all(v.device.type == "cpu" for s in raw["optimizer"]["state"].values() for v in s.values())
    back = journal.load(path, expect_hash="h", expect_names={"w"}, device=META)
    assert back.gates["w"].device == META
    for s in back.optimizer["state"].values():
        for k, v in s.items():
            if isinstance(v, torch.Tensor) and k != "step":
                assert v.device == META


def test_sync_gate_grads_stays_on_the_gates_device():
    from voodoo_quant.distributed.parallel import sync_gate_grads

    class _One:  # a 1-rank group: all_reduce is the identity, devices are what is checked
        rank, world, is_main = 0, 1, True

        def all_reduce(self, t, op="sum"):
            return t

    a = nn.Parameter(torch.zeros(3, device=META))
    b = nn.Parameter(torch.zeros(2, device=META))
    a.grad = torch.ones(3, device=META)
    sync_gate_grads([a, b], _One())
    assert a.grad.device == META and b.grad.device == META and b.grad.shape == (2,)
