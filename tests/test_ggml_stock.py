"""The bridge's bytes equal stock ``llama-quantize`` output, tensor for tensor (slow).

A 2-layer random Llama (hidden 256 so K/IQ types apply) is converted to F32 GGUF by the vendored
convert_hf_to_gguf.py, an imatrix is made by stock ``llama-imatrix`` on real text, then each type
is quantized once by ``llama-quantize --pure`` and by the bridge, and every block tensor compared.
"""

from __future__ import annotations

import subprocess

import numpy as np
import pytest

from voodoo_quant.core import paths
from voodoo_quant.core import qtypes as qt

pytestmark = pytest.mark.slow

# One llama-quantize run each. The imatrix ones include every type that needs one
# (IQ2_S, IQ2_XXS, IQ1_S), and K/IQ types whose imatrix path differs from the plain one.
PLAIN = ["Q8_0", "Q6_K", "Q5_K", "Q3_K", "IQ4_NL", "Q5_0", "Q4_0", "MXFP4"]
WITH_IMATRIX = ["Q4_K", "Q2_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S"]

# llama-quantize takes a file type (llama_ftype), not a ggml type. Its IQ2_S file type writes
# IQ2_XS tensors; the ggml IQ2_S type is the default of file type IQ2_M
# (src/llama-quant.cpp llama_ftype_get_default_type). MXFP4 is file type MXFP4_MOE's default,
# which --pure writes on every tensor (without --pure only expert stacks get it; the 576-wide rows
# of a dense model may take it from a voodoo menu). All other names here map to themselves.
STOCK_FTYPE = {"IQ2_S": "IQ2_M", "MXFP4": "MXFP4_MOE"}


def _run(cmd: list[str], cwd=None) -> None:
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True, cwd=cwd, timeout=600)
    assert r.returncode == 0, f"{cmd[0]} failed ({r.returncode}):\n{r.stderr[-3000:]}"


def _reader(path):
    from gguf import GGUFReader

    return GGUFReader(str(path))


@pytest.fixture(scope="module")
def tiny_f32_gguf(imatrix_llama256_gguf):
    # The shared 2-layer random Llama (hidden 256, intermediate 512, tied, SmolLM2 tokenizer),
    # converted to F32 by the vendored convert_hf_to_gguf.py (tests/conftest.py).
    return imatrix_llama256_gguf


@pytest.fixture(scope="module")
def stock_imatrix(tiny_f32_gguf, shakespeare_text_file, tmp_path_factory):
    out = tmp_path_factory.mktemp("stock_imatrix") / "imatrix.gguf"
    _run([paths.tool_path("llama-imatrix"), "-m", tiny_f32_gguf, "-f", shakespeare_text_file, "-o", out,
          "-c", "128", "--chunks", "4", "-t", "2", "--no-ppl"])
    r = _reader(out)
    sums = {t.name[: -len(".in_sum2")]: np.array(t.data, np.float32).reshape(-1)
            for t in r.tensors if t.name.endswith(".in_sum2")}
    counts = {t.name[: -len(".counts")]: np.array(t.data, np.float32).reshape(-1)
              for t in r.tensors if t.name.endswith(".counts")}
    # llama.cpp's exact arithmetic (tools/quantize/quantize.cpp load_imatrix): float / float;
    # a one-ulp difference changes K-quant bytes.
    vectors = {}
    for name, s in sums.items():
        assert counts[name].size == 1 and counts[name][0] > 0, name
        vectors[name] = s / np.float32(counts[name][0])
    assert any(k.startswith("blk.0.ffn_down") for k in vectors), sorted(vectors)
    return out, vectors


@pytest.fixture(scope="module")
def f32_tensors(tiny_f32_gguf):
    r = _reader(tiny_f32_gguf)
    out = {}
    for t in r.tensors:
        if t.name.startswith("blk.") and len(t.shape) == 2:
            assert t.tensor_type == 0, t.name  # F32
            # GGUFReader gives data in numpy (rows, n_per_row) order.
            out[t.name] = np.ascontiguousarray(np.array(t.data, np.float32))
    assert len(out) == 2 * 7, sorted(out)  # q k v o gate up down per layer
    return out


@pytest.mark.parametrize("qtype", PLAIN + WITH_IMATRIX)
def test_bridge_equals_llama_quantize(ggml_lib, tiny_f32_gguf, stock_imatrix, f32_tensors, qtype, tmp_path):
    from test_ggml_bridge import assert_same_bytes

    q = qt.get(qtype)
    use_imatrix = qtype in WITH_IMATRIX
    imatrix_file, vectors = stock_imatrix
    out = tmp_path / f"{qtype}.gguf"
    cmd = [paths.tool_path("llama-quantize"), "--pure", "--token-embedding-type", "q8_0"]
    if use_imatrix:
        cmd += ["--imatrix", imatrix_file]
    _run(cmd + [tiny_f32_gguf, out, STOCK_FTYPE.get(qtype, qtype), "2"])
    stock = {t.name: t for t in _reader(out).tensors}
    compared = 0
    for name, w in f32_tensors.items():
        t = stock[name]
        assert qt.by_id(int(t.tensor_type)).name == qtype, (name, t.tensor_type)
        im = vectors[name] if use_imatrix else None
        want = np.asarray(t.data).tobytes()
        assert_same_bytes(ggml_lib.quantize(w, q, im, name=name), want, q)
        if use_imatrix and compared == 0 and q.block == 256:
            # The imatrix really matters: a flat one gives other bytes (this test can fail).
            assert ggml_lib.quantize(w, q, np.ones_like(im), name=name) != want
        compared += 1
    assert compared == 14
