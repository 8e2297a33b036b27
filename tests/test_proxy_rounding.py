"""The "proxy" compensation sweep's torch rounding (candidates/proxy_rounding.py):

- Q8_0's torch rounding is libggml-base's quantization to the bit, so the proxy walk's Q8_0
  candidate is the ruled walk's;
- a K-quant superblock's coded scales give values libggml-base's quantizer gives back for most
  blocks, and the fit's error is within a few percent of the quantizer's own;
- IQ2_XXS's held values are given back by libggml-base for most blocks (the pre-scaling undoes
  the quantizer's scale fit), while the values the walk predicts without holding them are not;
- no grid type's own quantization is a fixed point of libggml-base's quantizer, while its levels
  held at the coded scale over stage 2's fudge factor are (but for sub-blocks out of its trials'
  reach); the held-level proxy's values of IQ3_S, IQ2_S, IQ1_S and IQ3_XXS are given back to the
  bit, with the ruler and scale codes the proxy chose, and only while every sub-block is in reach;
- the sweep's candidate is libggml-base's quantization of the W' it returns, deterministic, with
  a layer error below plain, and its cache digest is its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant.candidates import compensate, grid_probe, proxy_grids, proxy_rounding
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix, quantize_compensated
from voodoo_quant.core import ggml
from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import QuantizationInputError
from voodoo_quant.quants import decompose

from test_compensate import _out_err, _problem


def _weighted_err(W, R, imx):
    return float((((W - R) ** 2) * imx[None, :]).sum())


def test_q8_0_rounding_is_the_quantizers_to_the_bit():
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=11)
    W[3, 32:64] = 0.0  # an all-zero block: d = 0
    W[5, 0:32] = np.float32(0.5) * np.arange(32, dtype=np.float32) / 127  # halves at the d it picks
    D = lib.dequantize(lib.quantize(W, "Q8_0", imx), "Q8_0", W.shape)
    mine = proxy_rounding.round_q8_0(torch.from_numpy(W)).numpy()
    assert np.array_equal(mine, D)  # as values (±0 alike: a code of 0 is +0 in the file)
    assert np.array_equal(np.abs(mine).view(np.uint32), np.abs(D).view(np.uint32))
    # values Q8_0 stores are a fixed point of the quantizer
    again = lib.dequantize(lib.quantize(mine, "Q8_0", imx), "Q8_0", W.shape)
    assert np.array_equal(again, mine)
    with pytest.raises(QuantizationInputError):
        proxy_rounding.round_q8_0(torch.zeros(2, 48))


@pytest.mark.parametrize("q", ["Q4_K", "Q5_K"])
def test_kquant_scales_give_values_the_quantizer_gives_back(q):
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=12)
    Wt, v = torch.from_numpy(W), torch.from_numpy(imx.astype(np.float32))
    P = torch.cat([proxy_rounding.KQuantScales(Wt[:, b:b + 256], q, v[b:b + 256]).round(Wt[:, b:b + 256], 0, 256)
                   for b in range(0, 512, 256)], 1).numpy()
    again = lib.dequantize(lib.quantize(P, q, imx), q, W.shape)
    assert (again == P).reshape(-1, 32).all(1).mean() > 0.8
    plain = lib.dequantize(lib.quantize(W, q, imx), q, W.shape)
    assert _weighted_err(W, P, imx) < 1.05 * _weighted_err(W, plain, imx)
    with pytest.raises(QuantizationInputError):
        proxy_rounding.KQuantScales(Wt[:, :128], q, None)


def test_iq2_xxs_held_values_are_given_back_and_predictions_are_not():
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=13)
    Wt, v = torch.from_numpy(W), torch.from_numpy(imx.astype(np.float32))
    P, kept = torch.zeros_like(Wt), Wt.clone()
    for b0 in range(0, 512, 256):
        blk = kept[:, b0:b0 + 256]
        g = proxy_rounding.HeldGridProxy(blk, "IQ2_XXS", v[b0:b0 + 256])
        for c0 in range(0, 256, 32):
            P[:, b0 + c0:b0 + c0 + 32] = g.round(c0, blk)
            blk[:, c0:c0 + 32] = g.held
    P, kept = P.numpy(), kept.numpy()
    F = lib.dequantize(lib.quantize(kept, "IQ2_XXS", imx), "IQ2_XXS", W.shape)
    same = (F == P).reshape(-1, 32).all(1).mean()
    rel = np.abs(F - P).reshape(-1, 32).max(1) / np.abs(P).reshape(-1, 32).max(1)
    assert same > 0.7 and (rel <= 1e-3).mean() > 0.9
    # the stored values themselves are not a fixed point of the quantizer: its ruler moves
    back = lib.dequantize(lib.quantize(P, "IQ2_XXS", imx), "IQ2_XXS", W.shape)
    assert (back == P).reshape(-1, 32).all(1).mean() < 0.2
    plain = lib.dequantize(lib.quantize(W, "IQ2_XXS", imx), "IQ2_XXS", W.shape)
    assert _weighted_err(W, F, imx) < 1.02 * _weighted_err(W, plain, imx)


LEVELS = tuple(sorted(proxy_grids.SPECS))  # IQ1_S, IQ2_S, IQ3_S, IQ3_XXS


def _held_walk(W, imx, q):
    """The held-level proxy over every superblock of W with no compensation: each step rounded
    from the superblock as it stands, W' holding the step's held values. (values, W', the
    proxies, their codes)."""
    Wt = torch.from_numpy(W)
    v = None if imx is None else torch.from_numpy(imx.astype(np.float32))
    P, kept, codes, proxies = torch.zeros_like(Wt), Wt.clone(), torch.zeros_like(Wt), []
    for b0 in range(0, W.shape[1], 256):
        blk = kept[:, b0:b0 + 256]
        g = proxy_grids.HeldLevelProxy(blk, q, None if v is None else v[b0:b0 + 256])
        proxies.append(g)
        for c0 in range(0, 256, 32):
            P[:, b0 + c0:b0 + c0 + 32] = g.round(c0, blk)
            blk[:, c0:c0 + 32] = g.held
            codes[:, b0 + c0:b0 + c0 + 32] = g.code
    return P.numpy(), kept.numpy(), proxies, codes.numpy()


@pytest.mark.parametrize("q", LEVELS)
def test_grid_quantizations_are_not_fixed_points_but_held_levels_are(q):
    """libggml-base's own output, quantized again, moves (stage 2's fudge factor, and IQ2_S's and
    IQ3_XXS's levels differing from their stored magnitudes); the same values held as levels times
    ``fp32(d·(2l + 1)) / F`` come back, but for the few sub-blocks its trial scales cannot reach."""
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=16)
    data = lib.quantize(W, q, imx)
    D = lib.dequantize(data, q, W.shape)
    again = lib.dequantize(lib.quantize(D, q, imx), q, W.shape)
    assert (again == D).reshape(-1, 32).all(1).mean() < 0.05
    a = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), qt.get(q), W.shape)
    code = a.code.float().reshape(W.shape)
    scale = a.scale.unsqueeze(-1).expand(a.code.shape).reshape(W.shape)  # the dequantizer's db per value
    spec = proxy_grids.SPECS[q]
    if q == "IQ1_S":  # the decomposition's code is 8·(g + δ), its scale fp32(d·(2l + 1)) / 8
        code, scale = code / 8, scale * 8
    held = (scale / spec.kappa / spec.fudge * grid_probe.levels(code, qt.get(q))).numpy()
    back = lib.dequantize(lib.quantize(held, q, imx), q, W.shape)
    assert (back == D).reshape(-1, 32).all(1).mean() > 0.8


@pytest.mark.parametrize("q", LEVELS)
def test_held_level_proxy_values_are_given_back_to_the_bit(q):
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=17)
    P, kept, proxies, _ = _held_walk(W, imx, q)
    data = lib.quantize(kept, q, imx)
    assert np.array_equal(lib.dequantize(data, q, W.shape), P)
    # through libggml-base's fit of the held values: the ruler d is the proxy's, in every superblock
    d = np.frombuffer(data, dtype=np.uint8).reshape(64, 2, -1)[:, :, :2].copy().view(np.float16).astype(np.float32)
    assert np.array_equal(d.reshape(64, 2), torch.cat([g.d16 for g in proxies], 1).numpy())
    plain = lib.dequantize(lib.quantize(W, q, imx), q, W.shape)
    assert _weighted_err(W, P, imx) < _weighted_err(W, plain, imx)  # measured 0.85-0.93


@pytest.mark.parametrize("q", ["IQ2_S", "IQ3_S"])
def test_held_levels_are_given_back_whatever_the_search_weights(q):
    """Without an imatrix libggml-base weighs its search by x² (IQ2_S: σ²/4 + x²): held levels are
    an exact fit on the levels, so they come back all the same."""
    lib = ggml.lib()
    W, _, _, _ = _problem(rows=32, n=512, seed=21)
    P, kept, _, _ = _held_walk(W, None, q)
    assert np.array_equal(lib.dequantize(lib.quantize(kept, q, None), q, W.shape), P)


@pytest.mark.parametrize("q", ["IQ2_S", "IQ3_S"])
def test_a_sub_block_out_of_the_quantizers_reach_is_searched_again(q, monkeypatch):
    """Without the reach rule some held sub-blocks have no code at the level the quantizer's trial
    scales put a sub-block's largest value at, and libggml-base does not give them back; with it,
    every sub-block has one and every block comes back."""
    lib = ggml.lib()
    W, _, _, imx = _problem(rows=64, n=512, seed=18)
    g, reach = grid_probe.RULES[q][2], proxy_grids.SPECS[q].reach
    monkeypatch.setattr(proxy_grids, "REACH", False)
    P, kept, _, codes = _held_walk(W, imx, q)
    back = lib.dequantize(lib.quantize(kept, q, imx), q, W.shape)
    assert (back == P).reshape(-1, 32).all(1).mean() < 0.98
    assert (np.abs(codes).reshape(-1, g).max(1) < reach).any()
    monkeypatch.setattr(proxy_grids, "REACH", True)
    P, kept, _, codes = _held_walk(W, imx, q)
    assert np.array_equal(lib.dequantize(lib.quantize(kept, q, imx), q, W.shape), P)
    assert (np.abs(codes).reshape(-1, g).max(1) >= reach).all()


@pytest.mark.parametrize("q", ["Q8_0", "Q5_K", "IQ2_XXS", *LEVELS])
def test_proxy_candidate_is_the_quantization_of_its_w_prime(q):
    lib = ggml.lib()
    W, X, H, imx = _problem(rows=48, n=512, seed=14)
    comp = Compensation(H, 0.1, "proxy")
    rec: dict = {}
    Wp = compensated_matrix(W, q, imx, comp, lib, record=rec)
    data = quantize_compensated(W, q, imx, comp, lib=lib)
    assert data == lib.quantize(Wp, q, imx)
    assert np.array_equal(compensated_matrix(W, q, imx, comp, lib), Wp)  # deterministic
    assert _out_err(W, data, q, X) < _out_err(W, lib.quantize(W, q, imx), q, X)
    R = rec["rounding"]
    assert R.shape == W.shape and not np.isnan(R[:, :256]).any()
    if q == "Q8_0":  # the quantizer's rounding: the ruled walk's W' and bytes
        assert np.array_equal(Wp, compensated_matrix(W, q, imx, Compensation(H, 0.1, "ruled"), lib))
    if q == "Q8_0" or q in proxy_rounding.LEVELS:  # every step the walk rounded is the file's, to the bit
        F = lib.dequantize(data, q, W.shape)
        done = ~np.isnan(R)
        assert done.all() or q == "Q8_0"
        assert np.array_equal(F[done], R[done])


@pytest.mark.parametrize("q", sorted(proxy_rounding.LEVELS))
def test_the_held_level_proxy_leaves_less_output_error_than_the_ruled_walk(q):
    """The types the proxy rounds with held levels are those measured to leave less output error
    than the ruled walk (docs/lab/2026-12-07-proxy-grid-types.md: 0.85-0.93x on 256 x 1536)."""
    lib = ggml.lib()
    W, X, H, imx = _problem(rows=64, n=768, seed=19)
    proxy = _out_err(W, quantize_compensated(W, q, imx, Compensation(H, 0.1, "proxy"), lib=lib), q, X)
    ruled = _out_err(W, quantize_compensated(W, q, imx, Compensation(H, 0.1, "ruled"), lib=lib), q, X)
    assert proxy < ruled, (q, proxy / ruled)


def test_the_proxy_sweep_has_its_own_digest_and_is_not_the_default():
    _, _, H, _ = _problem(rows=4, n=256, seed=15)
    assert compensate.DEFAULT_SWEEP != "proxy" and "proxy" in compensate.SWEEPS
    digests = {s: Compensation(H, 0.1, s).digest for s in compensate.SWEEPS}
    assert len(set(digests.values())) == len(digests)


@pytest.mark.parametrize("module, name, value", [
    (proxy_rounding, "LEVELS", frozenset({"IQ3_S"})),
    (proxy_grids, "TRIALS", dict(proxy_grids.TRIALS, IQ2_S=(1.0,))),
    (proxy_grids, "REACH_TRIALS", dict(proxy_grids.REACH_TRIALS, IQ1_S=(1.0,))),
    (proxy_grids, "EXACT", dict(proxy_grids.EXACT, IQ3_S=3)),
    (proxy_grids, "WINDOW", dict(proxy_grids.WINDOW, IQ3_XXS=1)),
    (proxy_grids, "REACH", False),
])
def test_every_proxy_setting_enters_the_digest(module, name, value, monkeypatch):
    _, _, H, _ = _problem(rows=4, n=256, seed=15)
    key = Compensation(H, 0.1, "proxy").digest
    monkeypatch.setattr(module, name, value)
    if name == "LEVELS":
        monkeypatch.setattr(proxy_rounding, "TYPES", frozenset({"Q8_0", *proxy_rounding.KQUANTS, *proxy_rounding.GRIDS, *value}))
    assert Compensation(H, 0.1, "proxy").digest != key


def test_the_proxy_walks_a_type_it_does_not_round_as_ruled(monkeypatch):
    """A held-level type left out of LEVELS (and so of TYPES) is walked by the ruled probe: the
    proxy sweep's W' is then the ruled sweep's."""
    lib = ggml.lib()
    W, _, H, imx = _problem(rows=16, n=512, seed=20)
    monkeypatch.setattr(proxy_rounding, "LEVELS", proxy_rounding.LEVELS - {"IQ3_S"})
    monkeypatch.setattr(proxy_rounding, "TYPES", proxy_rounding.TYPES - {"IQ3_S"})
    ruled = compensated_matrix(W, "IQ3_S", imx, Compensation(H, 0.1, "ruled"), lib)
    assert np.array_equal(compensated_matrix(W, "IQ3_S", imx, Compensation(H, 0.1, "proxy"), lib), ruled)
