"""--sensitivity_kind measured: every rung's ΔKL measured with that one tensor quantized."""

import pytest
import torch
import torch.nn.functional as F

from voodoo_quant.core import ggml
from voodoo_quant.core.errors import ConfigError
from voodoo_quant.model.modeling import load_model
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.setup import candidate_blobs
from voodoo_quant.training.trainer import Trainer

MENU = ("Q8_0", "Q4_K", "Q2_K")


def _cfg(d, out, **kw):
    base = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=2,
                compression_ratio=0.6, candidate_types=MENU, output_dir=str(out), method="sensitivity",
                sensitivity_kind="measured", sensitivity_sequences=3)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def measured(gate_model_dir, tmp_path_factory):
    # plain candidates, which the direct computation below quantizes again
    tr = Trainer(_cfg(gate_model_dir, tmp_path_factory.mktemp("measured"), error_compensation="none"))
    res = tr.train()
    return tr, res


def _kl(teacher, student, tokens) -> float:
    """Mean KL(teacher ‖ student) over the predicted positions, by a full forward of each."""
    with torch.no_grad():
        t = F.log_softmax(teacher(input_ids=tokens).logits[:, :-1].double(), -1)
        s = F.log_softmax(student(input_ids=tokens).logits[:, :-1].double(), -1)
    return float((t.exp() * (t - s)).sum(-1).mean())


def test_each_entry_is_the_kl_of_the_model_with_that_one_tensor_at_that_rung(measured):
    tr, _ = measured
    run = tr.run
    calib = run.tokens[: run.cfg.sensitivity_sequences]
    teacher = load_model(run.cfg.model, dtype=torch.float32).eval()
    lib = ggml.lib()
    # a tensor of the last layer (its prefix replayed), one of the first, and the tied embedding /
    # LM head (a full forward, both uses)
    picks = [p for p in run.plans if p.name.endswith(("layers.1.self_attn.v_proj.weight",
                                                       "layers.0.mlp.down_proj.weight", "embed_tokens.weight"))]
    assert len(picks) == 3
    for plan in picks:
        w = dict(teacher.named_parameters())[plan.name].detach()
        blobs = candidate_blobs([plan], {plan.name: w}, {})[plan.name]
        for k, (t, blob) in enumerate(zip(plan.menu.types, blobs)):
            student = load_model(run.cfg.model, dtype=torch.float32).eval()
            wq = plan.layout.from_gguf(torch.from_numpy(lib.dequantize(blob, t, (plan.rows, plan.n_per_row)))).reshape(w.shape)
            with torch.no_grad():
                dict(student.named_parameters())[plan.name].copy_(wq)
            direct = _kl(teacher, student, calib)
            assert direct > 0
            # float32 forwards in another order than the replayed one: agreement to float32 rounding,
            # which moves the KL by an absolute ~1e-8 here (measured up to 2.9e-8 on an AMD EPYC
            # host), so a Q8_0 entry of 7e-6 is held to that, not to 2e-3 of itself
            assert run.sensitivity[plan.name][k] == pytest.approx(direct, rel=2e-3, abs=5e-8), (plan.name, t)
        row = run.sensitivity[plan.name]
        assert row[plan.menu.types.index("Q8_0")] < row[plan.menu.types.index("Q2_K")]


def test_the_pass_puts_every_weight_back_bit_for_bit(measured):
    tr, _ = measured
    fresh = dict(load_model(tr.cfg.model, dtype=torch.float32).named_parameters())
    for n, p in tr.run.student.named_parameters():
        assert torch.equal(p.detach(), fresh[n].detach()), n


def test_the_knapsack_of_the_measured_table_is_on_budget(measured):
    tr, res = measured
    b = tr.run.budget
    assert b.target_bytes * (1 - b.tolerance) <= res.assignment.total_bytes <= b.upper_bytes
    assert (tr.cfg.out_dir / "sensitivity.pt").exists()


def test_measured_is_refused_under_tensor_parallelism(gate_model_dir, tmp_path):
    with pytest.raises(ConfigError, match="sensitivity_kind fisher"):
        _cfg(gate_model_dir, tmp_path, tensor_parallel=2)
