"""Error compensation under ``--lazy``: the Hessians collected one decoder layer at a time from a
skeleton (training/layer_hessians.py) are the whole-model collection's file, byte for byte, on
every tensor-parallel architecture; and a ``--lazy`` run, which never loads the float model
whole, builds the very compensated candidates of the eager run (each in its own candidate cache,
so that each computes them), and trains and bakes the same gates on them."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    return tp_case.build_models(tmp_path_factory.mktemp("lazy_compensation_models"))


def _write(path: Path, c) -> bytes:
    from voodoo_quant.candidates.hessian_store import write_hessians

    write_hessians(path, c.sizes, c.shared, "key", c.arrays)
    return path.read_bytes()


@pytest.mark.parametrize("arch", tp_case.ARCHS)
def test_layer_by_layer_hessians_are_the_whole_model_file(models, arch, tmp_path):
    from voodoo_quant.candidates.hessian_store import load_hessians
    from voodoo_quant.model.lazyload import WeightReader, meta_names, text_skeleton
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.hessians import collect_passes
    from voodoo_quant.training.layer_hessians import collect_layerwise
    from voodoo_quant.training.setup import plan_run

    d = models[arch]
    whole = load_model(d / "model", dtype=torch.float32).eval()
    skel = text_skeleton(d / "model")
    skel.voodoo_reader = WeightReader(d / "model", skel)
    _, plans, _ = plan_run(tp_case.config(d, tmp_path / "out", 1), whole, None)
    tokens = torch.load(d / "data" / "train_tokens.pt", weights_only=True)[:7, :32]  # batches of 4 and 3
    before, bufs = meta_names(skel), dict(skel.named_buffers())

    ref = _write(tmp_path / "whole.safetensors", collect_passes(whole, plans, tokens))
    got = _write(tmp_path / "layers.safetensors", collect_layerwise(skel, plans, tokens))
    assert got == ref  # header (sizes, shared inputs, offsets) and every float
    hs = load_hessians(tmp_path / "layers.safetensors")
    stored = {id(h) for h in hs.values()}
    assert len(stored) < len(hs)  # q/k/v and gate/up read one input: stored once
    assert all(float(h.trace()) > 0 for h in hs.values())  # every input seen, the head's too
    assert any("embed" in n or "lm_head" in n for n in hs)
    # the skeleton is left as found: every parameter on meta, the same buffer objects
    assert meta_names(skel) == before and all(p.device.type == "meta" for p in skel.parameters())
    assert all(b is bufs[n] for n, b in skel.named_buffers())
    # other text is another file: the equality above can fail
    assert _write(tmp_path / "other.safetensors", collect_layerwise(skel, plans, tokens[1:])) != ref


def _cache_entries(root: Path) -> dict[str, tuple[bytes, str | None]]:
    out = {}
    for meta in root.rglob("meta.json"):
        m = json.loads(meta.read_text())
        out[meta.parent.name] = ((meta.parent / "data.bin").read_bytes(), m.get("compensation"))
    return out


def test_lazy_compensated_run_builds_and_trains_on_the_eager_candidates(models, tmp_path, monkeypatch, ggml_lib):
    from voodoo_quant.model import modeling
    from voodoo_quant.training.trainer import Trainer

    d = models["llama"]  # a tied embedding: compensated as the LM head, its Hessian taken after the layers
    kw = dict(error_compensation="auto", compensation_sequences=5, guarantee=True)
    loads = []
    real = modeling.load_model
    monkeypatch.setattr(modeling, "load_model", lambda *a, **k: loads.append(a) or real(*a, **k))
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path / "cache-lazy"))
    lazy = Trainer(tp_case.config(d, tmp_path / "lazy", 1, lazy=True, **kw))
    lz = lazy.train()
    assert loads == []  # the float model never loaded whole
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path / "cache-eager"))
    eager = Trainer(tp_case.config(d, tmp_path / "eager", 1, **kw))
    eg = eager.train()
    assert loads

    # auto is gptq under --lazy too, from the same Hessians file
    rl, re_ = lz.assignment.compensation, eg.assignment.compensation
    assert rl["method"] == re_["method"] == "gptq"
    assert {k: v for k, v in rl.items() if k != "hessians"} == {k: v for k, v in re_.items() if k != "hessians"}
    assert (tmp_path / "lazy" / "hessians.safetensors").read_bytes() == \
        (tmp_path / "eager" / "hessians.safetensors").read_bytes()
    # every candidate each run computed into its own cache: the same keys, the same bytes
    cl, ce = _cache_entries(tmp_path / "cache-lazy"), _cache_entries(tmp_path / "cache-eager")
    assert cl == ce
    assert sum(c is not None for _b, c in cl.values()) >= len(lz.assignment.tensors)  # compensated ones
    # and on them the same bake and guarantee. The losses agree to float rounding only, with or
    # without compensation: the eager run mixes int8 codes with the native kernel, --lazy the
    # dequantized packed bytes (the same values, summed in another order); step 0 is exact
    assert lz.assignment.to_dict()["tensors"] == eg.assignment.to_dict()["tensors"]
    assert lz.assignment.meta["guarantee"] == eg.assignment.meta["guarantee"]
    assert (lz.history[0].ce, lz.history[0].kl) == (eg.history[0].ce, eg.history[0].kl)
    assert [v for h in lz.history for v in (h.ce, h.kl, h.expected_bytes)] == pytest.approx(
        [v for h in eg.history for v in (h.ce, h.kl, h.expected_bytes)], rel=1e-5)
