"""The Fisher pass one decoder layer at a time (training/layerwise.py), on a skeleton, must give
the very curvature matrices of the whole-model pass on the loaded model: same products, same
order of every sum, so equal to the bit on the CPU, for every tensor-parallel architecture."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    return tp_case.build_models(tmp_path_factory.mktemp("layerwise_models"))


def _case(d: Path, out: Path):
    from voodoo_quant.model.lazyload import WeightReader, text_skeleton
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.setup import candidate_sources, plan_run, reader_weights

    whole = load_model(d / "model", dtype=torch.float32).eval()
    skel = text_skeleton(d / "model")
    skel.voodoo_reader = WeightReader(d / "model", skel)
    _, plans, _ = plan_run(tp_case.config(d, out, 1), whole, None)
    sources = candidate_sources(plans, reader_weights(whole, plans), {})
    tokens = torch.load(d / "data" / "train_tokens.pt", weights_only=True)[:3, :32]
    return whole, skel, plans, tokens, (lambda p: dict(zip(p.menu.types, sources(p))))


@pytest.mark.parametrize("arch", tp_case.ARCHS)
def test_layerwise_curvature_equals_the_whole_model_pass(tp_models, arch, tmp_path, ggml_lib):
    from voodoo_quant.model.lazyload import meta_names
    from voodoo_quant.training.fisher import curvature_table, fisher_diagonal
    from voodoo_quant.training.layerwise import layerwise_curvature
    from voodoo_quant.training.setup import reader_weights

    whole, skel, plans, tokens, blobs_for = _case(tp_models[arch], tmp_path)
    ref = curvature_table(plans, reader_weights(whole, plans), fisher_diagonal(whole, plans, tokens, seed=3), blobs_for)
    before = meta_names(skel)
    bufs = {n: b for n, b in skel.named_buffers()}
    got = layerwise_curvature(skel, plans, tokens, blobs_for, seed=3)
    assert set(got) == set(ref) == {p.name for p in plans}
    for name in ref:
        assert got[name]["types"] == ref[name]["types"], name
        assert got[name]["m"] == ref[name]["m"], name  # float for float
    # the skeleton is left as found: every parameter on meta, the same buffer objects
    assert meta_names(skel) == before
    assert all(p.device.type == "meta" for p in skel.parameters())
    assert all(b is bufs[n] for n, b in skel.named_buffers())
    # another label seed is another table: the comparison above can fail
    other = layerwise_curvature(skel, plans, tokens[:1], blobs_for, seed=4)
    assert any(other[n]["m"] != ref[n]["m"] for n in ref)


def test_a_model_that_transforms_its_embeddings_is_refused_with_the_way_out(tp_models, tmp_path, ggml_lib):
    """The pass feeds the stored hidden states straight to the layers and the head: a model whose
    code between the embedding and the first layer changes them (Gemma scales them) would get
    another table, so it is refused, with the flag that computes the table on the whole model."""
    from voodoo_quant.core.errors import ConfigError
    from voodoo_quant.model.lazyload import meta_names
    from voodoo_quant.training.layerwise import layerwise_curvature

    _whole, skel, plans, tokens, blobs_for = _case(tp_models["llama"], tmp_path)

    def scale(_mod, args, kwargs):
        kwargs["inputs_embeds"] = kwargs["inputs_embeds"] * 2.0
        return args, kwargs

    before = meta_names(skel)
    skel.model.register_forward_pre_hook(scale, with_kwargs=True)
    with pytest.raises(ConfigError, match="does not feed its embeddings.*--sensitivity_kind output"):
        layerwise_curvature(skel, plans, tokens, blobs_for)
    assert meta_names(skel) == before  # left as found


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_lazy_single_process_run_reads_one_tensor_at_a_time_and_writes_the_same_file(tp_models, arch, tmp_path,
                                                                                     monkeypatch, ggml_lib):
    """One process with --lazy builds skeletons: the student's candidates and the (Q8_0) teacher are
    read a tensor at a time, the Fisher table and the search's curvature are streamed layer by
    layer. Everything it measures and writes equals the run that loads the float32 model whole."""
    from voodoo_quant.model import modeling
    from voodoo_quant.training import models
    from voodoo_quant.training.trainer import Trainer

    d = tp_models[arch]
    kw = dict(lazy=True, teacher_quant="Q8_0", guarantee=True, search_evals=3, search_sequences=2)
    loads = []
    real = modeling.load_model
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    streamed = Trainer(tp_case.config(d, tmp_path / "streamed", 1, **kw)).train()
    assert loads == []  # never loaded whole
    monkeypatch.setattr(models, "can_load_sharded", lambda cfg: False)  # the whole-model path
    whole = Trainer(tp_case.config(d, tmp_path / "whole", 1, **kw)).train()
    assert loads
    assert [(h.ce, h.kl, h.expected_bytes) for h in streamed.history] == [(h.ce, h.kl, h.expected_bytes) for h in whole.history]
    assert streamed.assignment.meta["guarantee"] == whole.assignment.meta["guarantee"]
    assert {n: t.qtype for n, t in streamed.assignment.tensors.items()} == {n: t.qtype for n, t in whole.assignment.tensors.items()}
    assert streamed.assignment.meta["guarantee"]["search"]["evals"] > 0  # the search ran on the streamed curvature
