"""A Q8_0 teacher held packed (int8 qs + fp16 d per 32 weights, dequantized per layer on use) under
--lazy: its logits equal those of the dense teacher made from the same Q8_0 weights, bit for bit,
from --teacher_quant Q8_0 and from a voodoo-teacher/1 checkpoint, on one device and on every
tensor-parallel rank (sharded loading)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from voodoo_quant.training.teacher_q8 import is_packed, packed_bytes

sys.path.insert(0, str(Path(__file__).parent / "helpers"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tp_case import build_models

    return build_models(tmp_path_factory.mktemp("teacher_q8"), ("qwen3", "qwen3_5"))  # untied, tied


def _teacher_checkpoint(d: Path, out: Path) -> Path:
    """A voodoo-teacher/1 file as `voodoo make-teacher` writes it (checkpoints.teacher_entry)."""
    from voodoo_quant.core import fileio
    from voodoo_quant.model.checkpoints import TEACHER_FORMAT, teacher_entry
    from voodoo_quant.model.modeling import load_model

    m = load_model(d / "model")
    tensors = {n: teacher_entry(n, t.detach()) for n, t in m.state_dict().items() if n != "lm_head.weight"
               or not m.config.tie_word_embeddings}
    return fileio.torch_save(out / "teacher.pt", {"format": TEACHER_FORMAT, "tensors": tensors})


def _cfg(d, out, **kw):
    from tp_case import config

    return config(d, out, kw.pop("tp", 1), warm_start=False, polish=False, **kw)


def _dense_weights(model):
    return {n: m.weight.detach() for n, m in model.named_modules() if isinstance(m, (torch.nn.Linear, torch.nn.Embedding))}


@pytest.mark.parametrize("arch", ["qwen3", "qwen3_5"])
@pytest.mark.parametrize("source", ["teacher_quant", "checkpoint"])
@pytest.mark.parametrize("dtype", ["bfloat16", "float32"])
def test_packed_teacher_logits_equal_the_dense_teacher(models, tmp_path, arch, source, dtype, ggml_lib):
    from voodoo_quant.training.models import TORCH_DTYPES, load_models

    d = models[arch]
    kw = {"teacher_quant": "Q8_0"} if source == "teacher_quant" else {
        "teacher_checkpoint": str(_teacher_checkpoint(d, tmp_path))}
    teachers = {}
    for lazy in (False, True):
        _, teachers[lazy] = load_models(_cfg(d, tmp_path / str(lazy), lazy=lazy, dtype=dtype, **kw), TORCH_DTYPES[dtype])
    dense, packed = teachers[False], teachers[True]
    assert not any(is_packed(m) for m in dense.modules())
    n_packed = [n for n, m in packed.named_modules() if is_packed(m)]
    assert "model.embed_tokens" in n_packed and "lm_head" in n_packed and len(n_packed) >= 16
    numel = sum(m.weight.numel() for n, m in dense.named_modules() if n in n_packed and n != "lm_head") + (
        0 if dense.config.tie_word_embeddings else dense.lm_head.weight.numel())
    assert packed_bytes(packed) == numel * 34 // 32  # 8.5 bits per weight, the tied copy once
    assert all("weight" not in m._parameters for n, m in packed.named_modules() if n in n_packed)
    ids = torch.load(d / "data" / "train_tokens.pt")[:2, :32]
    with torch.no_grad():
        a, b = dense(input_ids=ids).logits, packed(input_ids=ids).logits
    assert a.dtype == b.dtype == TORCH_DTYPES[dtype] and torch.equal(a, b)
    wd, wp = _dense_weights(dense), _dense_weights(packed)
    for n in wd:
        assert torch.equal(wd[n], wp[n]), n


@pytest.mark.parametrize("arch,source", [("qwen3", "teacher_quant"), ("qwen3_5", "checkpoint")])
def test_sharded_packed_teacher_equals_the_dense_shards(models, tmp_path, arch, source, ggml_lib):
    from voodoo_quant.arch import adapter_for
    from voodoo_quant.distributed.parallel import TPContext, plan_tp
    from voodoo_quant.training.models import load_models, shard_teacher
    from voodoo_quant.training.setup import plan_run

    d = models[arch]
    kw = {"teacher_quant": "Q8_0"} if source == "teacher_quant" else {
        "teacher_checkpoint": str(_teacher_checkpoint(d, tmp_path))}
    for rank in range(2):
        tp = TPContext(rank, 2)
        got = {}
        for lazy in (False, True):
            cfg = _cfg(d, tmp_path / f"{lazy}", tp=2, lazy=lazy, dtype="bfloat16", **kw)
            base, sk = load_models(cfg, torch.bfloat16, sharded=True)
            _, plans, _ = plan_run(cfg, base)
            shard_teacher(sk, plan_tp(base, adapter_for(base.config), 2, plans), tp)
            got[lazy] = sk
        dense, packed = got[False], got[True]
        assert sum(is_packed(m) for m in packed.modules()) >= 16
        wd, wp = _dense_weights(dense), _dense_weights(packed)
        for n in wd:
            assert wd[n].dtype == wp[n].dtype and torch.equal(wd[n], wp[n]), (rank, n)
        pd = {n: t for n, t in dense.named_parameters() if not n.endswith(".weight")}
        pp = {n: t for n, t in packed.named_parameters() if not n.endswith(("q8_qs", "q8_d", ".weight"))}
        assert set(pd) == set(pp) and all(torch.equal(pd[n], pp[n]) for n in pd)
        # the packed bytes are this rank's part: about half of the unsplit teacher's
        assert packed_bytes(packed) < 0.6 * sum(w.numel() for w in wd.values()) * 34 / 32 * 2
