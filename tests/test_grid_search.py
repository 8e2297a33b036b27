"""The torch grid search (candidates/grid_search.py) against libggml-base's own bytes:

- for IQ2_XXS, IQ2_S, IQ3_S and IQ1_S, on small random matrices whose rows, sub-blocks and
  imatrix columns differ in scale, the packed bytes are libggml-base's, every byte (measured
  agreement on larger and real tensors: bench/grid_search_agreement.py); with zero sub-blocks and
  a zero superblock too; IQ2_S and IQ3_S also without an imatrix;
- the neighbour lists matter: the nearest entry over the whole grid gives other bytes;
- the arithmetic pieces are C's (nearest_int's bit trick, a correctly rounded sqrtf);
- inputs it cannot take are refused with a typed error before any work.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant.candidates import grid_search, grid_tables
from voodoo_quant.core.errors import QuantizationInputError


def _uneven(rows: int, n: int, seed: int):
    """Rows of different norms, 32-column sub-blocks of different energy, a spread imatrix vector."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((rows, n)) * np.exp(0.5 * rng.standard_normal((rows, 1)))
    W *= np.repeat(np.exp(0.6 * rng.standard_normal((rows, n // 32))), 32, axis=1)
    return W.astype(np.float32), np.exp(rng.standard_normal(n)).astype(np.float32)


def _ours(W, q, v) -> bytes:
    return grid_search.quantize(torch.from_numpy(W), q, v).numpy().tobytes()


@pytest.mark.parametrize("q", grid_search.TYPES)
def test_bytes_are_libggml_base(q, ggml_lib, grid_search_lattices):
    W, v = _uneven(12, 512, seed=3)
    ref = ggml_lib.quantize(W, q, v, workers=1)
    ours = _ours(W, q, v)
    assert len(ours) == len(ref)
    a = np.frombuffer(ref, np.uint8).reshape(-1, ggml_lib.row_size(q, 256))
    b = np.frombuffer(ours, np.uint8).reshape(a.shape)
    assert (a == b).all(1).mean() == 1.0, f"{q}: superblocks differing: {np.nonzero(~(a == b).all(1))[0]}"
    assert np.array_equal(grid_search.values(torch.from_numpy(W), q, v).numpy(), ggml_lib.dequantize(ref, q, W.shape))


@pytest.mark.parametrize("q", grid_search.TYPES)
def test_zero_sub_blocks_and_superblocks(q, ggml_lib, grid_search_lattices):
    W, v = _uneven(4, 512, seed=5)
    W[0, :256] = 0  # a whole superblock
    W[1, 32:64] = 0  # one 32-value sub-block
    W[2, 256 + 16:256 + 32] = 0  # half of one (an IQ2_S sub-block)
    W[3, 100] = 1e-20  # a tiny value beside zeros
    W[3, 96:100] = 0
    assert _ours(W, q, v) == ggml_lib.quantize(W, q, v, workers=1)


@pytest.mark.parametrize("q", ["IQ2_S", "IQ3_S"])
def test_without_imatrix(q, ggml_lib, grid_search_lattices):
    W, _ = _uneven(8, 512, seed=7)
    assert _ours(W, q, None) == ggml_lib.quantize(W, q, None, workers=1)


@pytest.mark.parametrize("q", ["IQ2_XXS", "IQ3_S"])
def test_neighbour_lists_are_needed(q, ggml_lib, grid_search_lattices, monkeypatch):
    """A plain nearest-entry search over the whole grid is not libggml-base's search (measured on
    Gaussian matrices and rows of real tensors: 2.3–2.4 % of 8-value groups differ for IQ2_XXS,
    5–6 % for IQ3_S; here, on 768 groups, 0.3 % for IQ2_XXS)."""
    W, v = _uneven(12, 512, seed=3)
    ref = np.frombuffer(ggml_lib.quantize(W, q, v, workers=1), np.uint8)
    monkeypatch.setattr(grid_tables, "EXHAUSTIVE", True)
    ex = grid_search.quantize(torch.from_numpy(W), q, v).numpy()
    a, b = (ggml_lib.dequantize(x.tobytes(), q, W.shape).reshape(-1, 8) for x in (ref, ex))
    differ = 1 - (a == b).all(1).mean()
    assert 0.001 < differ < 0.2, differ


def test_nearest_int_is_the_c_bit_trick():
    v = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, 2.4999998, 4194303.0, -7.5], dtype=torch.float32)
    assert grid_tables.nearest_int(v).tolist() == [0, 2, 2, 0, -2, 2, 4194303, -8]


def test_sqrtf_is_correctly_rounded():
    x = torch.from_numpy(np.random.default_rng(0).uniform(0, 10, 4096).astype(np.float32))
    want = np.sqrt(x.numpy().astype(np.float64)).astype(np.float32)  # one rounding of the exact root
    assert np.array_equal(grid_tables.sqrtf(x).numpy(), want)


def test_neighbour_lists_hold_the_nearest_shells(grid_search_lattices):
    """Every off-grid lattice point of IQ2_XXS lists the grid entries at its 2 smallest distances,
    sorted by (distance, index); on-grid points list nothing."""
    lat = grid_tables.lattice("IQ2_XXS")
    pts = (torch.arange(lat.kmap.numel())[:, None] // 3 ** torch.arange(8)) % 3
    for c in (1, 100, 4000, 6560):
        d2 = ((2 * pts[c] - 2 * lat.levels) ** 2).sum(1)
        got = lat.flat[lat.start[c]:lat.start[c] + lat.length[c]]
        if lat.kmap[c] >= 0:
            assert lat.length[c] == 0
            continue
        shells = torch.unique(d2)[:2]
        want = torch.nonzero(d2 <= shells[-1]).squeeze(1)
        want = want[torch.argsort(d2[want] * 10_000 + want)]
        assert got.tolist() == want.tolist()


def test_refuses_what_it_cannot_take(grid_search_lattices):
    W, v = _uneven(2, 512, seed=1)
    with pytest.raises(QuantizationInputError, match="256"):
        grid_search.quantize(torch.from_numpy(W[:, :300].copy()), "IQ3_S", v[:300])
    with pytest.raises(QuantizationInputError, match="imatrix"):
        grid_search.quantize(torch.from_numpy(W), "IQ2_XXS", None)
    bad = W.copy()
    bad[0, 3] = np.nan
    with pytest.raises(QuantizationInputError, match="non-finite"):
        grid_search.quantize(torch.from_numpy(bad), "IQ2_S", v)
    with pytest.raises(QuantizationInputError, match="no torch grid search"):
        grid_search.quantize(torch.from_numpy(W), "Q4_K", v)
    with pytest.raises(QuantizationInputError, match="imatrix"):
        grid_search.quantize(torch.from_numpy(W), "IQ3_S", v[:256])
