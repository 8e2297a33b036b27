"""quants/recode.py: codes written back into libggml-base's blocks, checked against libggml-base."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant.core import ggml
from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import QuantizationInputError
from voodoo_quant.quants import decompose, recode
from voodoo_quant.quants.grids import table


def _matrix(rows=8, n=512, seed=0):
    g = np.random.default_rng(seed)
    return (g.standard_normal((rows, n)) * np.exp(g.standard_normal((rows, 1)))).astype(np.float32)


@pytest.mark.parametrize("q", sorted(recode.TYPES))
def test_a_quantization_recoded_with_its_own_codes_is_unchanged(q):
    lib = ggml.lib()
    W = _matrix()
    data = lib.quantize(W, q, np.abs(W).mean(0) ** 2)
    blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, qt.get(q).type_size)
    a = decompose(blocks.reshape(-1), q, W.shape)
    assert recode.recode(blocks, q, a.code.reshape(blocks.shape[0], 256)).numpy().tobytes() == data


@pytest.mark.parametrize("q", sorted(recode.TYPES))
def test_libggml_dequantizes_written_codes_at_the_blocks_own_scales(q):
    lib = ggml.lib()
    W = _matrix(seed=1)
    data = lib.quantize(W, q, None)
    Q = qt.get(q)
    blocks = torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, Q.type_size)
    a = decompose(blocks.reshape(-1), q, W.shape)
    g = torch.Generator().manual_seed(2)
    if q == "IQ4_XS":
        code = table("kvalues_iq4nl", "cpu")[torch.randint(0, 16, (blocks.shape[0], 256), generator=g)]
    else:
        lo, hi = recode._RANGE[q]
        code = torch.randint(lo, hi + 1, (blocks.shape[0], 256), generator=g)
    new = recode.recode(blocks, q, code)
    assert torch.equal(blocks, torch.frombuffer(bytearray(data), dtype=torch.uint8).view(-1, Q.type_size))  # a copy
    want = a.scale.unsqueeze(-1) * code.view(a.code.shape).float()
    if a.offset is not None:
        want = want + a.offset.unsqueeze(-1)
    got = lib.dequantize(new.numpy().tobytes(), q, W.shape)
    assert np.array_equal(got, want.reshape(W.shape).numpy())
    assert not np.array_equal(got, lib.dequantize(data, q, W.shape))


def test_codes_the_type_cannot_store_are_refused():
    lib = ggml.lib()
    W = _matrix(rows=1, n=256)
    for q, bad in (("Q4_K", 16), ("Q6_K", -33), ("IQ4_XS", 0)):
        blocks = torch.frombuffer(bytearray(lib.quantize(W, q, None)), dtype=torch.uint8).view(1, -1)
        with pytest.raises(QuantizationInputError):
            recode.recode(blocks, q, torch.full((1, 256), bad))
    with pytest.raises(QuantizationInputError, match="no code writer"):
        recode.recode(torch.zeros(1, 34, dtype=torch.uint8), "Q8_0", torch.zeros(1, 256))
