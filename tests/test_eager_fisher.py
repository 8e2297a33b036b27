"""The Fisher pass of a loaded model, one decoder layer at a time in place (training/layerwise.py):
the very curvature matrices and sensitivity table of the whole-model pass (``fisher_diagonal``)
on the CPU, on every tensor-parallel architecture (a tied embedding, an untied head, linear
attention, short convolutions), never more than one layer's Fisher accumulators beside the
embedding's and head's, and the model left exactly as it was found. A model the road refuses
(Granite scales its embeddings) is run whole."""

from __future__ import annotations

import logging
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402
from model_state import same_state, state  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tp_case.build_models(tmp_path_factory.mktemp("eager_fisher_models"))


def _case(d: Path, out: Path):
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.setup import candidate_sources, plan_run, reader_weights

    model = load_model(d / "model", dtype=torch.float32).eval()
    _, plans, _ = plan_run(tp_case.config(d, out, 1), model, None)
    weights = reader_weights(model, plans)
    sources = candidate_sources(plans, weights, {})
    return model, plans, weights, (lambda p: dict(zip(p.menu.types, sources(p))))


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(2))


class _Counting:
    """Wraps ``layerwise.FisherHooks``: the most Fisher accumulators alive at once."""

    def __init__(self, monkeypatch):
        from voodoo_quant.training import layerwise

        self.most = 0
        real = layerwise.FisherHooks
        outer = self

        class Hooks(real):
            def linears(self, names):
                outer.most = max(outer.most, len(self.fisher))
                return super().linears(names)

            def embedding(self, *a):
                outer.most = max(outer.most, len(self.fisher))
                return super().embedding(*a)

        monkeypatch.setattr(layerwise, "FisherHooks", Hooks)


@pytest.mark.parametrize("arch", tp_case.ARCHS)
def test_a_loaded_model_gives_the_whole_model_curvature_one_layer_at_a_time(models, arch, tmp_path, monkeypatch,
                                                                            ggml_lib):
    from voodoo_quant.training.fisher import curvature_table, fisher_diagonal
    from voodoo_quant.training.layerwise import _layer_index, layerwise_curvature

    model, plans, weights, blobs_for = _case(models[arch], tmp_path)
    tokens = _tokens(3)
    ref = curvature_table(plans, weights, fisher_diagonal(model, plans, tokens, seed=3), blobs_for)
    model.train()  # modes are put back module by module, not reset to eval or train as a whole
    model.model.layers[0].eval()
    before = state(model)
    count = _Counting(monkeypatch)
    got = layerwise_curvature(model, plans, tokens, blobs_for, seed=3)
    assert same_state(before, state(model))
    assert set(got) == set(ref) == {p.name for p in plans}
    for name in ref:
        assert got[name]["types"] == ref[name]["types"], name
        assert got[name]["m"] == ref[name]["m"], name  # float for float
    # never every tensor's accumulator: the embedding's and head's, and one layer's
    outside = sum(1 for p in plans if _layer_index(p.modules[0], "model.layers") is None)
    per_layer = max(sum(1 for p in plans if _layer_index(p.modules[0], "model.layers") == i) for i in range(2))
    assert 0 < count.most <= outside + per_layer < len(plans), (count.most, outside, per_layer, len(plans))
    # another label seed is another table: the comparison above can fail
    model.eval()
    other = layerwise_curvature(model, plans, tokens[:1], blobs_for, seed=4)
    assert any(other[n]["m"] != ref[n]["m"] for n in ref)


def test_the_sensitivity_table_of_a_loaded_model_takes_the_layer_road(models, tmp_path, monkeypatch, ggml_lib):
    """``ensure_table`` on a loaded model: the layer road (no whole-model Fisher pass, no diagonals
    kept), the table and curvature of the whole-model pass."""
    from voodoo_quant.training import fisher, layerwise
    from voodoo_quant.training.sensitivity import ensure_table

    model, plans, weights, blobs_for = _case(models["llama"], tmp_path)
    tokens = _tokens(3)
    cfg = SimpleNamespace(sensitivity_kind="fisher", sensitivity_sequences=2, model="m", seed=5, out_dir=tmp_path / "o")
    ref = fisher.curvature_table(plans, weights, fisher.fisher_diagonal(model, plans, tokens[:2], seed=5), blobs_for)
    whole = []
    real = fisher.fisher_diagonal
    monkeypatch.setattr(layerwise, "fisher_diagonal", lambda *a, **k: whole.append(1) or real(*a, **k))
    sens = ensure_table(cfg, model, plans, {}, tokens)
    assert whole == [] and sens.fisher is None
    assert sens.curvature == ref
    assert sens.table == {n: [c["m"][k][k] for k in range(len(c["types"]))] for n, c in ref.items()}


def _granite(tmp_path: Path):
    import transformers as T

    torch.manual_seed(0)
    cfg = T.GraniteConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                          tie_word_embeddings=True, embedding_multiplier=2.0)
    d = tmp_path / "granite"
    T.GraniteForCausalLM(cfg).save_pretrained(d / "model")
    return d


def test_a_model_the_layer_road_refuses_is_run_whole(tmp_path, caplog, ggml_lib):
    """Granite scales its embeddings between the embedding and the first decoder layer: its layers
    cannot be fed from the recorded embeddings, so a loaded Granite's pass runs on the whole model
    (its diagonals kept for the search), with a log line."""
    from voodoo_quant.training.fisher import curvature_table, fisher_diagonal
    from voodoo_quant.training.layerwise import LayerwiseUnsupported, fisher_curvature, layerwise_curvature

    model, plans, weights, blobs_for = _case(_granite(tmp_path), tmp_path)
    tokens = _tokens(2)
    before = state(model)
    with pytest.raises(LayerwiseUnsupported, match="embeddings"):
        layerwise_curvature(model, plans, tokens, blobs_for)
    assert same_state(before, state(model))
    ref = curvature_table(plans, weights, fisher_diagonal(model, plans, tokens, seed=1), blobs_for)
    with caplog.at_level(logging.INFO, logger="voodoo_quant.training.layerwise"):
        curv, fish = fisher_curvature(model, plans, tokens, blobs_for, weights, seed=1)
    assert curv == ref and set(fish) == {p.name for p in plans}
    assert "not layer by layer" in caplog.text and "the whole model instead" in caplog.text, caplog.text
