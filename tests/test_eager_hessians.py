"""Error compensation's Hessians of a loaded model, one decoder layer at a time in one forward
(training/layer_hessians.py run in place): byte for byte the file of the whole-model collection
in several passes (training/hessians.py ``collect_passes``), on every tensor-parallel
architecture (a tied embedding, q/k/v and gate/up reading one input, linear attention, short
convolutions), and the model left exactly as it was found."""

from __future__ import annotations

import logging
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402
from model_state import same_state as _same_state, state as _state  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tp_case.build_models(tmp_path_factory.mktemp("eager_hessians_models"))


def _loaded(d: Path, tmp_path: Path):
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.setup import plan_run

    model = load_model(d / "model", dtype=torch.float32).eval()
    _, plans, _ = plan_run(tp_case.config(d, tmp_path / "out", 1), model, None)
    return model, plans


def _tokens(n: int) -> torch.Tensor:
    return torch.randint(0, 512, (n, 32), generator=torch.Generator().manual_seed(2))


def _write(path: Path, c) -> bytes:
    from voodoo_quant.candidates.hessian_store import write_hessians

    write_hessians(path, c.sizes, c.shared, "key", c.arrays)
    return path.read_bytes()


@pytest.mark.parametrize("arch", tp_case.ARCHS)
def test_a_loaded_model_gives_the_whole_model_file_in_one_forward(models, arch, tmp_path, caplog):
    from voodoo_quant.candidates.hessian_store import load_hessians
    from voodoo_quant.training.compensation import write_if_missing
    from voodoo_quant.training.hessians import collect_passes

    model, plans = _loaded(models[arch], tmp_path)
    tokens = _tokens(11)  # batches of 4, 4 and 3
    passes = collect_passes(model, plans, tokens, pass_bytes=3 * 256 ** 2 * 4)  # a few inputs per pass
    assert passes.passes > 2
    ref = _write(tmp_path / "passes.safetensors", passes)
    with caplog.at_level(logging.INFO, logger="voodoo_quant.training.compensation"):
        assert write_if_missing(tmp_path / "run" / "hessians.safetensors", "key", model, plans, tokens)
    assert (tmp_path / "run" / "hessians.safetensors").read_bytes() == ref  # header, offsets and every float
    assert "the loaded model in place), 1 forward(s)" in caplog.text, caplog.text
    hs = load_hessians(tmp_path / "passes.safetensors")
    assert len({id(h) for h in hs.values()}) < len(hs)  # q/k/v and gate/up read one input: stored once
    assert all(float(h.trace()) > 0 for h in hs.values())  # every input seen, the head's too
    assert any("embed" in n or "lm_head" in n for n in hs)
    if arch == "llama":  # tied: the embedding is compensated as the LM head, with H of the final hidden states
        assert "model.embed_tokens.weight" in hs and "lm_head.weight" not in hs


def test_the_equality_sees_the_order_of_the_batches(models, tmp_path):
    """The same batches summed in another order give another file: the equality above checks the
    road's order of sums, not merely its values."""
    from voodoo_quant.training.hessians import collect_passes
    from voodoo_quant.training.layer_hessians import collect_layerwise

    model, plans = _loaded(models["llama"], tmp_path)
    tokens = _tokens(12)  # three whole batches
    backwards = torch.cat([tokens[8:], tokens[4:8], tokens[:4]])
    ref = _write(tmp_path / "passes.safetensors", collect_passes(model, plans, tokens, pass_bytes=1))
    assert _write(tmp_path / "layers.safetensors", collect_layerwise(model, plans, tokens)) == ref
    assert _write(tmp_path / "backwards.safetensors", collect_layerwise(model, plans, backwards)) != ref
    # and the same sequences batched otherwise
    assert _write(tmp_path / "by3.safetensors", collect_layerwise(model, plans, tokens, batch_size=3)) != ref


@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_the_loaded_model_is_left_as_it_was_found(models, arch, tmp_path):
    from voodoo_quant.training.compensation import write_if_missing

    model, plans = _loaded(models[arch], tmp_path)
    model.train()  # modes are put back module by module, not reset to eval or train as a whole
    model.model.layers[0].eval()
    before = _state(model)
    assert write_if_missing(tmp_path / "hessians.safetensors", "key", model, plans, _tokens(5))
    after = _state(model)
    assert _same_state(before, after)
    assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in model.parameters())
    # the comparison can fail: one value changed is seen
    with torch.no_grad():
        model.model.norm.weight[0] += 1
    assert not _same_state(before, _state(model))


def test_a_model_the_layer_road_refuses_is_collected_whole_in_passes(tmp_path, caplog):
    """Granite scales its embeddings between the embedding and the first decoder layer, so its
    layers cannot be fed from the recorded embeddings: a loaded Granite is collected whole, in
    passes, into the same file."""
    import transformers as T

    from voodoo_quant.training.compensation import write_if_missing
    from voodoo_quant.training.hessians import collect_passes
    from voodoo_quant.training.layer_hessians import LayerwiseUnsupported, collect_layerwise

    torch.manual_seed(0)
    cfg = T.GraniteConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                          num_key_value_heads=2, num_hidden_layers=2, max_position_embeddings=128,
                          tie_word_embeddings=True, embedding_multiplier=2.0)
    d = tmp_path / "granite"
    T.GraniteForCausalLM(cfg).save_pretrained(d / "model")
    model, plans = _loaded(d, tmp_path)
    tokens = _tokens(6)
    with pytest.raises(LayerwiseUnsupported, match="embeddings"):
        _write(tmp_path / "refused.safetensors", collect_layerwise(model, plans, tokens))
    assert not (tmp_path / "refused.safetensors").exists()
    ref = _write(tmp_path / "passes.safetensors", collect_passes(model, plans, tokens, pass_bytes=1))
    with caplog.at_level(logging.INFO, logger="voodoo_quant.training.compensation"):
        assert write_if_missing(tmp_path / "hessians.safetensors", "key", model, plans, tokens)
    assert (tmp_path / "hessians.safetensors").read_bytes() == ref
    assert "the whole model, 1 forward(s)" in caplog.text, caplog.text
