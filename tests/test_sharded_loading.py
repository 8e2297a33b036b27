"""Sharded loading under tensor parallelism: a rank builds the model as a skeleton (parameters on
`meta`) and reads only its shards; what it ends up with must equal, tensor for tensor and byte for
byte, what loading the whole model and splitting it gives (the path every rank took before)."""

from __future__ import annotations

import pytest
import torch

from voodoo_quant.distributed.parallel import TPContext, apply_tp, plan_tp

MENU = ("Q8_0", "Q5_0", "Q4_1", "Q4_0")


@pytest.fixture(scope="module")
def qwen35_dir(tmp_path_factory):
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).parent / "helpers"))
    from tp_case import build_models

    return build_models(tmp_path_factory.mktemp("sharded"), ("qwen3_5", "qwen3"))


def _cfg(d, out, **kw):
    from voodoo_quant.training.config import TrainConfig

    base = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=1,
                compression_ratio=0.62, candidate_types=MENU, output_dir=str(out), tensor_parallel=2,
                warm_start=False, polish=False)
    base.update(kw)
    return TrainConfig(**base)


def _state(model) -> dict[str, torch.Tensor]:
    out = {}
    for n, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        out[n] = t.detach()
    return out


def test_skeleton_holds_no_weights_but_computes_its_buffers(qwen35_dir):
    from voodoo_quant.model.lazyload import meta_names, text_skeleton
    from voodoo_quant.model.modeling import load_model

    d = qwen35_dir["qwen3_5"] / "model"
    sk = text_skeleton(d)
    full = load_model(d)
    params = dict(sk.named_parameters())
    assert params and all(p.device.type == "meta" for p in params.values())
    assert sk.lm_head.weight is sk.model.embed_tokens.weight  # tied as the loaded model is
    bufs = dict(full.named_buffers())
    for n, b in sk.named_buffers():
        assert b.device.type == "cpu" and torch.equal(b, bufs[n]), n
    assert set(meta_names(sk)) == set(dict(full.named_parameters()))


def test_reader_shards_equal_slices_of_the_whole_tensor(qwen35_dir):
    from voodoo_quant.arch import adapter_for
    from voodoo_quant.model.lazyload import WeightReader, text_skeleton
    from voodoo_quant.model.modeling import load_model

    d = qwen35_dir["qwen3_5"] / "model"
    sk = text_skeleton(d)
    full = dict(load_model(d).named_parameters(remove_duplicate=False))
    reader = WeightReader(d, sk)
    plan = plan_tp(sk, adapter_for(sk.config), 2)
    assert plan.params
    for name, sh in plan.params.items():
        for r in range(2):
            got = reader.get_shard(name, sh.dim, sh.bounds(r, 2), full[name].shape)
            assert torch.equal(got, sh.take(full[name], r, 2)), (name, r)


@pytest.mark.parametrize("arch,teacher_quant,dtype", [("qwen3_5", "Q8_0", "bfloat16"), ("qwen3", None, "float32")])
def test_sharded_teacher_equals_the_split_whole_teacher(qwen35_dir, tmp_path, arch, teacher_quant, dtype, ggml_lib):
    from voodoo_quant.training.models import TORCH_DTYPES, load_models, shard_teacher
    from voodoo_quant.training.setup import plan_run

    cfg = _cfg(qwen35_dir[arch], tmp_path, teacher_quant=teacher_quant, dtype=dtype)
    for rank in range(2):
        tp = TPContext(rank, 2)
        _, whole = load_models(cfg, TORCH_DTYPES[dtype])
        base, sk = load_models(cfg, TORCH_DTYPES[dtype], sharded=True)
        _, plans, _ = plan_run(cfg, base)
        tp_plan = plan_tp(base, __import__("voodoo_quant.arch", fromlist=["adapter_for"]).adapter_for(base.config), 2, plans)
        apply_tp(whole, tp_plan, tp)
        shard_teacher(sk, tp_plan, tp)
        a, b = _state(whole), _state(sk)
        assert set(a) == set(b)
        for n in a:
            assert a[n].device == b[n].device and a[n].dtype == b[n].dtype and torch.equal(a[n], b[n]), (arch, rank, n)
        for n, m in sk.named_modules():  # same per-rank head counts
            w = dict(whole.named_modules())[n]
            for attr in ("num_k_heads", "num_v_heads", "key_dim", "value_dim", "num_embeddings"):
                assert getattr(m, attr, None) == getattr(w, attr, None), (n, attr)


@pytest.mark.parametrize("lazy", [False, True])
def test_sharded_student_candidates_are_byte_exact(qwen35_dir, tmp_path, lazy, ggml_lib):
    from voodoo_quant.arch import adapter_for
    from voodoo_quant.training.models import load_models
    from voodoo_quant.training.setup import build_student, plan_run

    cfg = _cfg(qwen35_dir["qwen3_5"], tmp_path, lazy=lazy)
    for rank in range(2):
        tp = TPContext(rank, 2)
        built = []
        for sharded in (False, True):
            base, _ = load_models(cfg, torch.float32, sharded=sharded)
            _, plans, budget = plan_run(cfg, base)
            tp_plan = plan_tp(base, adapter_for(base.config), 2, plans)
            mixed = build_student(cfg, base, plans, budget, {}, torch.device("cpu"), torch.float32, tp=tp,
                                  tp_plan=tp_plan)
            apply_tp(base, tp_plan, tp, gated=mixed)
            built.append((base, mixed))
        (wb, wm), (sb, sm) = built
        assert set(wm) == set(sm)
        for n in wm:
            a, b = wm[n], sm[n]
            if lazy:
                assert [bytes(p.numpy()) for p in a._get.packed] == [bytes(p.numpy()) for p in b._get.packed], n
            else:
                assert torch.equal(a.stacked, b.stacked), n
            for k in range(a.k):
                assert torch.equal(a.candidate(k), b.candidate(k)), (n, k)
        a, b = _state(wb), _state(sb)
        assert set(a) == set(b)
        for n in a:
            assert torch.equal(a[n], b[n]), (rank, n)


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_a_float_teacher_loaded_whole_shares_the_base_float32_weights_and_survives_the_student_build(
        qwen35_dir, tmp_path, dtype, ggml_lib):
    """One process loading whole: the teacher is the base's own float32 tensors (float32 run) or
    cast straight from them, not a second float32 model; building the student (which drops and
    replaces the base's weights) leaves the teacher equal, bit for bit, to a model loaded apart."""
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.models import TORCH_DTYPES, load_models
    from voodoo_quant.training.setup import build_student, plan_run

    d = qwen35_dir["qwen3"]
    cfg = _cfg(d, tmp_path, tensor_parallel=1, dtype=dtype)
    base, teacher = load_models(cfg, TORCH_DTYPES[dtype])
    assert teacher is not base
    b, t = _state(base), _state(teacher)
    assert set(b) == set(t)
    for n in b:
        if b[n].is_floating_point():
            assert t[n].dtype == TORCH_DTYPES[dtype], n
        shared = t[n].data_ptr() == b[n].data_ptr()
        assert shared == (dtype == "float32" or not b[n].is_floating_point()), n
    _, plans, budget = plan_run(cfg, base)
    build_student(cfg, base, plans, budget, {}, torch.device("cpu"), TORCH_DTYPES[dtype])
    ref = load_model(cfg.model, dtype=torch.float32).to(TORCH_DTYPES[dtype]).eval()
    r, t = _state(ref), _state(teacher)
    assert set(r) == set(t)
    for n in r:
        assert r[n].dtype == t[n].dtype and torch.equal(r[n], t[n]), n
    ids = torch.load(d / "data" / "train_tokens.pt", weights_only=True)[:1, :16]
    with torch.no_grad():
        assert torch.equal(teacher(input_ids=ids).logits, ref(input_ids=ids).logits)


def test_a_q8_teacher_loaded_whole_is_its_own_copy(qwen35_dir, tmp_path, ggml_lib):
    """A teacher changed in place (Q8_0 round trip) must not change the base it was copied from."""
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.models import load_models

    cfg = _cfg(qwen35_dir["qwen3"], tmp_path, tensor_parallel=1, teacher_quant="Q8_0")
    base, teacher = load_models(cfg, torch.float32)
    ref = _state(load_model(cfg.model, dtype=torch.float32))
    b, t = _state(base), _state(teacher)
    assert all(torch.equal(b[n], ref[n]) for n in ref)
    assert any(not torch.equal(t[n], ref[n]) for n in ref)
