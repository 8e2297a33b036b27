"""The "proxy" compensation sweep's torch rounding (candidates/proxy_rounding.py):

- Q8_0's torch rounding is libggml-base's quantization to the bit, so the proxy walk's Q8_0
  candidate is the ruled walk's;
- a K-quant superblock's coded scales give values libggml-base's quantizer gives back for most
  blocks, and the fit's error is within a few percent of the quantizer's own;
- IQ2_XXS's held values are given back by libggml-base for most blocks (the pre-scaling undoes
  the quantizer's scale fit), while the values the walk predicts without holding them are not;
- the sweep's candidate is libggml-base's quantization of the W' it returns, deterministic, with
  a layer error below plain, and its cache digest is its own.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant.candidates import compensate, proxy_rounding
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix, quantize_compensated
from voodoo_quant.core import ggml
from voodoo_quant.core.errors import QuantizationInputError

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


@pytest.mark.parametrize("q", ["Q8_0", "Q5_K", "IQ2_XXS"])
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
        F = lib.dequantize(data, q, W.shape)
        done = ~np.isnan(R)
        assert np.array_equal(F[done], R[done])


def test_the_proxy_sweep_has_its_own_digest_and_is_not_the_default():
    _, _, H, _ = _problem(rows=4, n=256, seed=15)
    assert compensate.DEFAULT_SWEEP != "proxy" and "proxy" in compensate.SWEEPS
    digests = {s: Compensation(H, 0.1, s).digest for s in compensate.SWEEPS}
    assert len(set(digests.values())) == len(digests)
