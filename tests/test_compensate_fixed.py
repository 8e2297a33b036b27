"""The "fixed" compensation sweep (compensation_walk.py, fixed_rounding.py) and export's use of the
candidates training read.

- the rounding with a superblock's scales held fixed gives back the quantizer's own values for
  the values it quantized (K-quants: the quantizer's codes from the weights themselves too);
- the factor in half the work is the Cholesky factor of the damped inverse Hessian;
- a compensated candidate is libggml-base's quantization of the returned W' (the exactness
  contract), the same bits on every call, and lowers the layer error at least as the per-step
  sweep does (within a few percent) for the types it rounds itself;
- a grid IQ superblock is quantized at every step but the row's last; IQ2_XXS's steps by a probe
  of 8 rows' step columns, within 2 % of the per-step walk's layer error;
- export writes the cached candidate only when its bytes are the ones the assignment recorded,
  computes it again otherwise, and refuses bytes that differ from the recorded hash.
"""

from __future__ import annotations

import hashlib

import numpy as np
import pytest
import torch

from voodoo_quant.candidates import compensate, compensation_walk, grid_probe
from voodoo_quant.core import ggml
from voodoo_quant.core import qtypes as qt
from voodoo_quant.candidates.cache import CandidateCache
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix, quantize_compensated
from voodoo_quant.candidates.fixed_rounding import SWEEP_TYPES, FixedScales, supports

from test_compensate import _out_err, _problem

# the grid types whose tables initialize in well under a second (IQ1_*, IQ2_S and IQ2_XS take tens
# of seconds on 2 cores): free signs, ksigns parity, groups of 4 and of 8
ROUNDED = ("Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "IQ2_XXS")


@pytest.mark.parametrize("q", ROUNDED)
def test_fixed_rounding_gives_back_the_quantizers_values(q):
    lib = ggml.lib()
    assert supports(q)
    W, _, _, imx = _problem(rows=32, n=256, tokens=512, seed=7)
    data = lib.quantize(W, q, imx)
    D = lib.dequantize(data, q, W.shape)
    fs = FixedScales(data, q, 32, 256, imx)
    again = torch.cat([fs.round(torch.from_numpy(D[:, c:c + 32]), c, c + 32) for c in range(0, 256, 32)], 1).numpy()
    assert np.array_equal(again, D)  # (as values: ±0 alike) the scales and offsets read back are the file's
    if q in SWEEP_TYPES and q != "IQ4_XS":  # nearest code in range is what quantize_row_q*_K does last
        mine = torch.cat([fs.round(torch.from_numpy(W[:, c:c + 32]), c, c + 32) for c in range(0, 256, 32)], 1)
        assert np.array_equal(mine.numpy(), D)


def test_the_reversed_factor_is_the_inverse_of_the_cholesky_factor_of_the_inverse():
    _, _, H, _ = _problem(rows=4, n=256, tokens=1024, seed=8)
    H[:, 17] = H[17, :] = 0
    U64, dead64 = compensate._cholesky_factor(H, 0.1)
    M, dead32 = compensate._reversed_factor(H, 0.1)
    assert M.dtype == torch.float32 and np.array_equal(dead64, dead32)
    assert torch.equal(M, torch.triu(M)) and bool((torch.diagonal(M) > 0).all())
    Hd = torch.from_numpy(H.astype(np.float64))
    Hd[17, 17] = 1.0
    Hd += 0.1 * float(torch.diagonal(Hd)[~torch.from_numpy(dead64)].mean()) * torch.eye(256, dtype=torch.float64)
    torch.testing.assert_close(M.double() @ M.double().T, Hd, rtol=1e-5, atol=1e-6 * float(Hd.abs().max()))
    torch.testing.assert_close(torch.linalg.inv(M.double()), U64, rtol=2e-4, atol=1e-6 * float(U64.abs().max()))
    assert bool((M[17, 18:] == 0).all() and (M[:17, 17] == 0).all())  # a dead column couples to nothing


@pytest.mark.parametrize("q", ["Q5_0", "Q4_K", "IQ2_XXS"])
def test_the_sweep_is_gptqs_update_with_the_whole_inverse_factor(q):
    """The walk in M's groups (no n × n inverse) is the textbook walk with U = M⁻¹, each step's
    error passed to every later column at once: the same layer error (measured 0.999-1.000x; the
    two differ where a rounding tie falls the other way and its change is passed on), where
    dropping the passing on between groups costs 1.4-1.5x."""
    lib = ggml.lib()
    W, X, H, imx = _problem(rows=24, n=512, tokens=2048, seed=13)
    H[:, 40] = H[40, :] = 0
    qq = qt.get(q)
    B = lib.block_size(qq)
    M, dead = compensate._reversed_factor(H, 0.1)
    got, _ = compensation_walk.sweep_fixed(W.copy(), qq, imx, M, dead, lib, B)
    want = _textbook_sweep(W, qq, imx, torch.linalg.inv(M.double()).float(), dead, lib, B)
    err = [_out_err(W, lib.quantize(np.ascontiguousarray(x), qq, imx), qq, X) for x in (got, want, W)]
    assert abs(err[0] / err[1] - 1) < 0.01 and err[2] > 1.3 * err[1], err
    if q not in SWEEP_TYPES:  # (those hold their rounding in W')
        assert np.array_equal(got[:, 40], W[:, 40])  # a dead column: nothing reaches it


def _textbook_sweep(m, q, imatrix, U, dead, lib, B):
    """The fixed sweep as the module docstring writes it: each step's error passed to every later
    column at once through the full U."""
    from voodoo_quant.candidates import fixed_rounding

    rows, n = m.shape
    W = torch.from_numpy(m.copy())
    live = torch.from_numpy(~dead).float()
    fixed = B > 32 and q.name in fixed_rounding.SWEEP_TYPES
    scales = None
    for s0 in range(0, n, 32):
        s1, b0 = s0 + 32, (s0 // B) * B
        if s1 == n and not fixed:
            break
        v = None if imatrix is None else imatrix[b0:b0 + B]
        if fixed and s0 != b0:
            Q = scales.round(W[:, s0:s1], s0 - b0, s1 - b0)
        else:
            blk = np.ascontiguousarray(W[:, b0:b0 + B].numpy())
            data = lib.quantize(blk, q, v)
            Q = torch.from_numpy(lib.dequantize(data, q, blk.shape)[:, s0 - b0:s1 - b0])
            scales = fixed_rounding.FixedScales(data, q, rows, B, v) if fixed else None
        err = torch.linalg.solve_triangular(U[s0:s1, s0:s1], (W[:, s0:s1] - Q) * live[s0:s1], upper=True, left=False)
        if fixed:
            W[:, s0:s1] = Q
        W[:, s1:] -= err @ U[s0:s1, s1:]
    return W.numpy()


@pytest.mark.parametrize("q", ["Q8_0", "Q5_0", "Q4_K", "Q6_K", "IQ4_XS", "IQ2_XXS"])
def test_the_candidate_is_the_quantizers_output_for_w_prime_every_time(q, monkeypatch):
    lib = ggml.lib()
    W, _, H, imx = _problem(rows=16, n=512, tokens=2048, seed=9)
    c = Compensation(H, 0.1, "fixed")
    assert c.sweep == "fixed"
    m = compensated_matrix(W, q, imx, c)
    data = quantize_compensated(W, q, imx, c)
    assert data == quantize_compensated(W, q, imx, Compensation(H.copy(), 0.1, "fixed"))  # deterministic
    assert data != lib.quantize(W, q, imx)
    if compensation_walk.writes(qt.get(q), lib.block_size(q)):
        # the walk wrote the bytes: they hold W' (its rounding) to the bit, with the scales
        # libggml-base chose for each superblock when the walk reached it
        assert np.array_equal(lib.dequantize(data, q, W.shape), m)
        monkeypatch.setattr(compensation_walk, "WRITE_CODES", False)
        assert compensation_walk.writes(qt.get(q), lib.block_size(q)) is False
        assert quantize_compensated(W, q, imx, c) == lib.quantize(m, q, imx)  # the same W'; the bytes quantized again
    else:
        assert data == lib.quantize(m, q, imx)  # the bytes are libggml-base's for the returned W'


@pytest.mark.parametrize("q", ["Q2_K", "Q4_K", "Q5_K", "Q6_K", "IQ4_XS"])
def test_written_bytes_leave_no_more_layer_error_than_quantizing_w_prime_again(q):
    """The file holds the walk's rounding in every block, so the error the walk passed on is the
    file's. Measured on this problem 0.93-0.99x the layer error of libggml-base's quantization
    of W' again (which chooses its scales anew), and on 1536 x 1536 random problems 0.94-0.99x
    (bench/compensation_cost.py --sweeps packed-requant,packed)."""
    lib = ggml.lib()
    W, X, H, imx = _problem(rows=32, n=512, tokens=2048, seed=9)
    c = Compensation(H, 0.1, "packed")
    m = compensated_matrix(W, q, imx, c)
    written = _out_err(W, quantize_compensated(W, q, imx, c), q, X)
    again = _out_err(W, lib.quantize(m, q, imx), q, X)
    plain = _out_err(W, lib.quantize(W, q, imx), q, X)
    assert written <= again < plain, (written, again, plain)


@pytest.mark.parametrize("q", ["Q4_K", "Q5_K", "Q2_K"])
def test_the_fixed_sweep_is_no_worse_than_the_per_step_one(q):
    """Measured 0.95-0.97x the per-step sweep's layer error on these types (bench/compensation_cost.py,
    random problems; 0.89-1.0x on SmolLM2's ffn_down): the superblock it hands the quantizer holds
    values its scales represent, so the error passed on is the file's."""
    W, X, H, imx = _problem(seed=10)
    fixed = _out_err(W, quantize_compensated(W, q, imx, Compensation(H, 0.01, "fixed")), q, X)
    per_step = _out_err(W, quantize_compensated(W, q, imx, Compensation(H, 0.01, "requant")), q, X)
    assert fixed < 1.02 * per_step, (fixed, per_step)


def test_sweeps_key_the_cache_apart_and_refuse_unknown_names():
    from voodoo_quant.core.errors import QuantizationInputError

    _, _, H, _ = _problem(rows=4, n=256, tokens=512, seed=11)
    assert Compensation(H, 0.1, "fixed").digest != Compensation(H, 0.1, "requant").digest
    with pytest.raises(QuantizationInputError, match="sweep"):
        Compensation(H, 0.1, "fast")


def test_export_writes_the_recorded_bytes_or_refuses(tmp_path):
    from voodoo_quant.training.provenance import ProvenanceMismatchError
    from voodoo_quant.tools.export import candidate_bytes

    W, _, H, imx = _problem(rows=16, n=256, tokens=1024, seed=12)
    c = Compensation(H, 0.1, "fixed")
    cache = CandidateCache(tmp_path)
    trained = quantize_compensated(W, "Q4_K", imx, c)
    want = hashlib.sha256(trained).hexdigest()
    key = CandidateCache.key(W, "Q4_K", imx, compensation=c)
    cache.put(key, trained)
    real = compensate.compensated_matrix
    try:  # a verified cache entry is written as it is: nothing is computed
        compensate.compensated_matrix = lambda *a, **k: (_ for _ in ()).throw(AssertionError("recomputed"))
        assert candidate_bytes(cache, W, "Q4_K", imx, c, want, name="w") == trained
    finally:
        compensate.compensated_matrix = real
    # an entry under the right key whose bytes are not training's is not written: computed again
    other = quantize_compensated(W, "Q4_K", imx, Compensation(H, 0.3, "fixed"))
    assert other != trained
    cache.put(key, other)
    assert candidate_bytes(cache, W, "Q4_K", imx, c, want, name="w") == trained
    # computed bytes that are not the recorded ones: refused, or written under the override
    with pytest.raises(ProvenanceMismatchError, match="w: the compensated Q4_K bytes"):
        candidate_bytes(CandidateCache(tmp_path / "empty"), W, "Q4_K", imx, c, "0" * 64, name="w")
    assert candidate_bytes(CandidateCache(tmp_path / "empty"), W, "Q4_K", imx, c, "0" * 64, name="w",
                           allow=True) == trained
    with pytest.raises(ProvenanceMismatchError, match="w: the Q4_K bytes"):  # plain candidates are checked too
        candidate_bytes(cache, W, "Q4_K", imx, None, want, name="w")


class _Counted:
    """libggml-base with its quantize calls counted."""

    def __init__(self, lib):
        self.lib, self.calls, self.weights = lib, 0, 0

    def __getattr__(self, name):
        return getattr(self.lib, name)

    def quantize(self, matrix, *a, **k):
        self.calls += 1
        self.weights += matrix.size
        return self.lib.quantize(matrix, *a, **k)


def test_a_grid_superblock_is_quantized_at_every_step_but_the_rows_last(monkeypatch):
    """The grid IQ types outside PACKED walk with libggml-base on the whole superblock at every
    32-column step (compensation_walk.GRID_STEPS is None: the cheaper variants measured worse,
    docs/lab/2026-12-05-grid-compensation.md); the row's last step has no later column to pass its
    error to, so it costs no call. A variant named by GRID_STEPS quantizes only at those steps and
    still hands libggml-base W' for the bytes."""
    lib = ggml.lib()
    W, _, H, imx = _problem(rows=8, n=512, tokens=1024, seed=13)
    c = Compensation(H, 0.1, "fixed")
    assert compensation_walk.GRID_STEPS is None and "IQ3_S" not in compensation_walk.PACKED
    counted = _Counted(lib)
    m = compensated_matrix(W, "IQ3_S", imx, c, counted)
    assert counted.calls == 512 // 32 - 1 and counted.weights == counted.calls * 8 * 256
    monkeypatch.setattr(compensation_walk, "GRID_STEPS", frozenset({0, 4}))
    counted = _Counted(lib)
    m2 = compensated_matrix(W, "IQ3_S", imx, c, counted)
    assert counted.calls == 4 and not np.array_equal(m, m2)
    assert quantize_compensated(W, "IQ3_S", imx, c) == lib.quantize(m2, "IQ3_S", imx)


def test_a_packed_step_is_quantized_as_one_probe_of_its_own_columns(monkeypatch):
    """IQ2_XXS (compensation_walk.PACKED): each step (but the row's last) costs one libggml-base call on
    the step's 32 columns of every row, 8 rows to a 256-wide probe row (rows padded to 8), and the
    probe's rounding of a row's columns is what libggml-base gives them in that probe."""
    lib = ggml.lib()
    assert not compensation_walk.PACKED  # the default walks every grid type per step (compensation_walk.py)
    monkeypatch.setattr(compensation_walk, "PACKED", frozenset({"IQ2_XXS"}))
    W, _, H, imx = _problem(rows=12, n=512, tokens=1024, seed=14)
    counted = _Counted(lib)
    compensated_matrix(W, "IQ2_XXS", imx, Compensation(H, 0.1, "fixed"), counted)
    assert counted.calls == 512 // 32 - 1 and counted.weights == counted.calls * 16 * 32
    x = torch.from_numpy(W[:, 64:96].copy())
    Q = grid_probe.probe_rounding(x, qt.get("IQ2_XXS"), imx[64:96], lib, 256).numpy()
    probe = np.concatenate([W[:8, 64:96].reshape(1, 256), np.concatenate(
        [W[8:, 64:96], np.zeros((4, 32), np.float32)]).reshape(1, 256)])
    want = lib.dequantize(lib.quantize(probe, "IQ2_XXS", np.tile(imx[64:96], 8)), "IQ2_XXS", probe.shape)
    assert np.array_equal(Q, want.reshape(16, 32)[:12])


def test_the_packed_walk_is_within_two_percent_of_the_per_step_one(monkeypatch):
    """Measured 1.008-1.021x the per-step walk's layer error for IQ2_XXS at 2.0-2.5x a plain
    candidate's cost, against 9.0-9.8x (bench/compensation_cost.py --sweeps fixed-step,fixed-pack)."""
    W, X, H, imx = _problem(seed=10)
    per_step = _out_err(W, quantize_compensated(W, "IQ2_XXS", imx, Compensation(H, 0.01, "fixed")), "IQ2_XXS", X)
    monkeypatch.setattr(compensation_walk, "PACKED", frozenset({"IQ2_XXS"}))
    packed = _out_err(W, quantize_compensated(W, "IQ2_XXS", imx, Compensation(H, 0.01, "fixed")), "IQ2_XXS", X)
    assert packed != per_step and packed < 1.02 * per_step, (packed, per_step)


@pytest.mark.parametrize("q", sorted(compensation_walk.PACKED_PROXY))
def test_the_packed_sweep_rounds_its_proxy_types_as_the_proxy_sweep_does(q):
    """`compensation_walk.PACKED_PROXY`: no libggml-base call during the walk, the walk of the
    "proxy" sweep, the bytes libggml-base's for that W', and a cache key of their own."""
    lib = ggml.lib()
    W, _, H, imx = _problem(rows=12, n=512, tokens=1024, seed=15)
    c = Compensation(H, 0.1, "packed")
    counted = _Counted(lib)
    m = compensated_matrix(W, q, imx, c, counted)
    assert counted.calls == 0
    assert np.array_equal(m, compensated_matrix(W, q, imx, Compensation(H, 0.1, "proxy")))
    assert quantize_compensated(W, q, imx, c) == lib.quantize(m, q, imx)
    assert c.digest_for(q) not in {c.digest, Compensation(H, 0.1, "proxy").digest_for(q)}
    assert c.digest_for("IQ3_S") == c.digest  # a type whose walk is the probe's keeps the sweep's key


@pytest.mark.parametrize("q", sorted(compensation_walk.PACKED_SWEEP - compensation_walk.PACKED_PROXY))
def test_the_packed_sweep_walks_every_grid_type_with_the_probe(q):
    """`--compensation_sweep packed`: each grid IQ step (but the row's last) is one probe call, the
    bytes are libggml-base's for the walked W', and the cache keys it apart from "fixed"."""
    lib = ggml.lib()
    W, _, H, imx = _problem(rows=12, n=512, tokens=1024, seed=15)
    c = Compensation(H, 0.1, "packed")
    assert c.digest != Compensation(H, 0.1, "fixed").digest
    counted = _Counted(lib)
    m = compensated_matrix(W, q, imx, c, counted)
    assert counted.calls == 512 // 32 - 1 and counted.weights == counted.calls * 16 * 32
    assert quantize_compensated(W, q, imx, c) == lib.quantize(m, q, imx)
    fixed = compensated_matrix(W, q, imx, Compensation(H, 0.1, "fixed"))
    assert not np.array_equal(m, fixed)
    # the K-quants and 32-block types walk as in "fixed"
    assert np.array_equal(compensated_matrix(W, "Q4_K", imx, c), compensated_matrix(W, "Q4_K", imx, Compensation(H, 0.1, "fixed")))


def test_a_type_whose_walk_changed_gets_a_cache_key_of_its_own_and_the_others_keep_theirs():
    """Written bytes (compensation_walk.WRITE_CODES) and the packed sweep's proxy types change
    those types' candidates only: every other type keeps the key its cached candidates have."""
    _, _, H, _ = _problem(rows=4, n=256, tokens=512, seed=3)
    for sweep in ("ruled", "fixed", "packed"):
        c = Compensation(H, 0.1, sweep)
        assert compensate.writes_bytes(sweep, "Q4_K") and c.digest_for("Q4_K") != c.digest
        assert not compensate.writes_bytes(sweep, "Q8_0") and c.digest_for("Q8_0") == c.digest
        assert not compensate.writes_bytes(sweep, "IQ3_S") and c.digest_for("IQ3_S") == c.digest
    for sweep in ("requant", "proxy"):
        c = Compensation(H, 0.1, sweep)
        assert not compensate.writes_bytes(sweep, "Q4_K") and c.digest_for("Q4_K") == c.digest
    key = CandidateCache.key(np.zeros((4, 256), np.float32), "Q5_K", compensation=Compensation(H, 0.1))
    assert key.compensation == Compensation(H, 0.1).digest_for("Q5_K")


@pytest.mark.parametrize("sweep", ["packed", "proxy"])
def test_the_held_iq3_xxs_bytes_the_walk_writes_are_the_quantizers_for_w_prime(sweep, monkeypatch):
    """IQ3_XXS under the proxy holds levels libggml-base gives back: the bytes the walk writes from
    them (proxy_grids.HeldLevelProxy.written) are libggml-base's quantization of the held W', to
    the byte, and with WRITE_HELD off that quantization is what the candidate is."""
    lib = ggml.lib()
    for seed in (21, 22):
        W, _, H, imx = _problem(rows=24, n=512, tokens=2048, seed=seed)
        c = Compensation(H, 0.1, sweep)
        m, data = compensate.compensated(W, "IQ3_XXS", imx, c)
        assert data is not None and data == lib.quantize(m, "IQ3_XXS", imx)
    assert c.digest_for("IQ3_XXS") != c.digest
    monkeypatch.setattr(compensation_walk, "WRITE_HELD", False)
    assert compensate.compensated(W, "IQ3_XXS", imx, c)[1] is None
    assert quantize_compensated(W, "IQ3_XXS", imx, c) == data
