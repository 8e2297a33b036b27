"""Rounding a grid IQ step from a probe (candidates/grid_probe.py), checked against libggml-base:

- the scale rule (each sub-block's scale the weighted least-squares fit on its levels, coded
  against the superblock's largest) reproduces the scales libggml-base stores, for every grid type;
- a probe whose positions carry their own row's weights picks the grid points the row's own
  superblock would; the repeated imatrix slice does not;
- on a superblock as it stands, the ruled rounding of each step is the file's values;
- the ruled walk's candidate is libggml-base's quantization of its W', the same bits every time,
  keyed apart in the candidate cache, and within a few percent of the per-step walk's layer error.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant.candidates import compensate, compensation_walk, grid_probe
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix, quantize_compensated
from voodoo_quant.core import qtypes as qt
from voodoo_quant.quants import decompose

from test_compensate import _out_err, _problem

# every grid type (the slow-to-initialize IQ1_*, IQ2_S and IQ2_XS included: their rules differ)
GRID = tuple(grid_probe.RULES)
# the ones whose tables initialize in well under a second
FAST = ("IQ3_S", "IQ3_XXS", "IQ2_XXS")


def _uneven(rows: int, n: int, seed: int):
    """Rows of different norms whose 32-column sub-blocks differ in energy (so the superblock's
    σ² and largest scale matter), and an imatrix vector spread over columns."""
    rng = np.random.default_rng(seed)
    W = rng.standard_normal((rows, n)) * np.exp(rng.standard_normal((rows, 1)))
    W *= np.repeat(np.exp(0.6 * rng.standard_normal((rows, n // 32))), 32, axis=1)
    imx = np.exp(rng.standard_normal(n))
    return W.astype(np.float32), imx.astype(np.float32)


def _pattern_mismatch(P: np.ndarray, F: np.ndarray) -> float:
    """The fraction of 16-value groups of P that are not F's values times one factor (another grid
    point or sign, not only another scale)."""
    p, f = P.reshape(-1, 16).astype(np.float64), F.reshape(-1, 16).astype(np.float64)
    a = (p * f).sum(1, keepdims=True) / np.maximum((f * f).sum(1, keepdims=True), 1e-300)
    return float((~np.all(np.abs(p - a * f) <= 1e-4 * np.abs(p).max(1, keepdims=True) + 1e-30, axis=1)).mean())


def _probe_all(W, q, imx, lib, weights):
    """Every 32-column step of W rounded by the probe, as the walk hands it (rows ÷ their RMS)."""
    Wt, P = torch.from_numpy(W), np.empty_like(W)
    for c0 in range(0, W.shape[1], 32):
        b0 = c0 // 256 * 256
        sq = Wt[:, b0:b0 + 256].square()
        norm = sq.mean(1, keepdim=True).sqrt()
        ms = sq.mean(1) / norm.squeeze(1).square()
        P[:, c0:c0 + 32] = (grid_probe.probe_rounding(Wt[:, c0:c0 + 32] / norm, q, imx[c0:c0 + 32], lib, 256, ms,
                                                      weights) * norm).numpy()
    return P


@pytest.mark.parametrize("q", GRID)
def test_the_scale_rule_is_the_one_libggml_base_stores(ggml_lib, q):
    """Fitted on the levels libggml-base chose, with its weights, each sub-block's scale s coded
    as clamp(nint((DIV·s/max s − 1)/2), 0, LMAX) gives the stored scales: stored = K·(2l + 1), one K
    per superblock, in every group."""
    qq = qt.get(q)
    W, imx = _uneven(32, 512, seed=1)
    data = ggml_lib.quantize(W, qq, imx)
    a = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), qq, W.shape)
    div, lmax, g, _ = grid_probe.RULES[q]
    blocks = a.code.shape[0]
    x = torch.from_numpy(W).double().reshape(blocks, 256)
    lev = grid_probe.levels(a.code.reshape(blocks, 256), qq)
    vec = torch.from_numpy(imx.astype(np.float64)).reshape(-1, 256).repeat(W.shape[0], 1)
    wt = vec * (grid_probe.SIGMA2_SCALE[q] * x.square().mean(1, keepdim=True) + x.square()).sqrt()
    s = grid_probe.fit(x, lev, wt, g)
    m = s.amax(1, keepdim=True)
    l = torch.clamp(torch.round(0.5 * (div * s / m - 1)), 0, lmax)
    stored = a.scale.double().reshape(blocks, -1)[:, :: (a.scale.shape[1] * g) // 256]
    K = stored / (2 * l + 1)
    assert torch.allclose(K, K[:, :1].expand_as(K), rtol=1e-5, atol=0)


@pytest.mark.parametrize("q", GRID)
def test_a_probe_with_its_rows_weights_picks_the_rows_grid_points(ggml_lib, q):
    """The probe superblock holds 8 rows' steps: with each position weighted as its own row's
    superblock weighs it, the grid points and signs are the file's (but where float rounding
    tips a near tie: measured 0–1.2 % of 16-value groups); with the imatrix slice repeated, the
    probe's σ² moves 2–5 % of them."""
    qq = qt.get(q)
    W, imx = _uneven(64, 512, seed=2)
    F = ggml_lib.dequantize(ggml_lib.quantize(W, qq, imx), qq, W.shape)
    row = _pattern_mismatch(_probe_all(W, qq, imx, ggml_lib, "row"), F)
    probe = _pattern_mismatch(_probe_all(W, qq, imx, ggml_lib, "probe"), F)
    assert row <= 0.02 and probe >= 0.015 and row < probe / 2


@pytest.mark.parametrize("q", FAST)
def test_the_ruled_rounding_of_a_superblock_as_it_stands_is_the_files(ggml_lib, q):
    """With nothing walked, a superblock's ruler (its own quantization, then each step from the
    probe with the scale coded against the superblock's largest) gives the file's values."""
    qq = qt.get(q)
    W, imx = _uneven(96, 256, seed=3)
    F = ggml_lib.dequantize(ggml_lib.quantize(W, qq, imx), qq, W.shape)
    Wt = torch.from_numpy(W)
    ruler = grid_probe.SuperblockRuler(Wt, qq, imx, ggml_lib)
    assert np.array_equal(ruler.first.numpy(), F)
    sq = Wt.square()
    norm = sq.mean(1, keepdim=True).sqrt()
    ms = sq.mean(1) / norm.squeeze(1).square()
    same = []
    for c0 in range(32, 256, 32):
        vals, code = grid_probe.probe_rounding(Wt[:, c0:c0 + 32] / norm, qq, imx[c0:c0 + 32], ggml_lib, 256, ms, "row",
                                               codes=True)
        got = ruler.round(c0, Wt, code, vals * norm).numpy()
        same.append(np.isclose(got, F[:, c0:c0 + 32], rtol=1e-5, atol=0).all(1))
    assert np.mean(same) >= 0.99, np.mean(same)  # measured 0.9985 (IQ3_XXS), 1.0 (IQ3_S, IQ2_XXS)


@pytest.mark.parametrize("q", FAST)
def test_the_ruled_walk_keeps_the_contract_and_the_per_step_walks_error(ggml_lib, q):
    """The candidate is libggml-base's quantization of the returned W', the same bits on every
    call, under a cache key of its own; its layer error is within 3 % of the per-step walk's
    (which quantizes each superblock at all 8 steps)."""
    W, X, H, imx = _problem(rows=32, n=512, tokens=2048, seed=21)
    per_step = quantize_compensated(W, q, imx, Compensation(H, 0.05, "fixed"))
    c = Compensation(H, 0.05, "ruled")
    assert c.digest not in {Compensation(H, 0.05, s).digest for s in ("fixed", "packed")}
    m = compensated_matrix(W, q, imx, c)
    ruled = quantize_compensated(W, q, imx, c)
    assert ruled == ggml_lib.quantize(m, q, imx) == quantize_compensated(W, q, imx, Compensation(H, 0.05, "ruled"))
    assert _out_err(W, ruled, q, X) <= 1.03 * _out_err(W, per_step, q, X)


def test_the_default_packed_walk_takes_the_ruled_walk_where_the_probe_is_unmeasured(ggml_lib):
    """Under "packed" (the default: TrainConfig's and compensate's agree), a ruled grid type outside
    PACKED_SWEEP and PACKED_PROXY is walked as under "ruled" (the same W', so the same bytes), not quantized again
    at every step; a type of PACKED_SWEEP takes the probe's own ruler (another W')."""
    from voodoo_quant.training.config import TrainConfig

    assert TrainConfig.__dataclass_fields__["compensation_sweep"].default == compensate.DEFAULT_SWEEP == "packed"
    assert compensation_walk.PACKED_RULED and not compensation_walk.PACKED_RULED & compensation_walk.PACKED_SWEEP
    W, X, H, imx = _problem(rows=16, n=512, tokens=2048, seed=5)
    assert compensation_walk.PACKED_RULED - compensation_walk.PACKED_PROXY  # (IQ2_XS; IQ3_XXS goes to the proxy)
    for name in sorted(compensation_walk.PACKED_RULED - compensation_walk.PACKED_PROXY):
        m_packed = compensated_matrix(W, name, imx, Compensation(H, 0.05, "packed"))
        assert np.array_equal(m_packed, compensated_matrix(W, name, imx, Compensation(H, 0.05, "ruled"))), name
        assert not np.array_equal(m_packed, compensated_matrix(W, name, imx, Compensation(H, 0.05, "fixed"))), name
    q = sorted(compensation_walk.PACKED_SWEEP)[0]
    assert not np.array_equal(compensated_matrix(W, q, imx, Compensation(H, 0.05, "packed")),
                              compensated_matrix(W, q, imx, Compensation(H, 0.05, "ruled")))
