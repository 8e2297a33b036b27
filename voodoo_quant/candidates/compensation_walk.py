"""The float32 walk of error compensation (compensate.py) under every sweep but "requant": a
matrix's columns walked a step of 32 at a time, a group at a time, each step's rounding taken from
the sweep's oracle and its error passed on to the columns not yet fixed.

It holds :func:`sweep_fixed` (the "ruled", "fixed", "packed" and "proxy" sweeps: which oracle
rounds a step, per type), :func:`_superblock_passes` (a grid superblock walked again from what the
previous pass left: a measured variant) and the walk's settings: which grid types each sweep
rounds from a probe (:data:`PACKED_SWEEP`) or against the superblock's ruler
(:data:`RULED_SWEEP`, :data:`PACKED_RULED`), and the measured variants bench sets here (the
``GRID_*`` and ``PACK_*`` settings, :data:`PACKED`). Every setting that changes a walk's bytes
enters :attr:`compensate.Compensation.digest`, which reads it from this module. The oracles
themselves are libggml-base, fixed_rounding.py (a superblock's scales held fixed), grid_probe.py
(a grid step rounded on a probe) and proxy_rounding.py (torch models of the quantizers).
"""

from __future__ import annotations

import warnings

import numpy as np

from ..core import qtypes as qt
from ..core.errors import QuantizationInputError
from ..quants import recode
from . import grid_probe

LAZY = 128  # columns of a 32-block type updated together before the rest of the row (one GEMM)
STEP = 32  # columns fixed per step: a block, or a 256-superblock's sub-block (its scale's span)
# the "fixed" sweep's grid IQ superblocks (fixed_rounding.supports, not SWEEP_TYPES): quantized by
# libggml-base again at the 32-column steps GRID_STEPS names (index within the superblock; None: all),
# the steps between rounded with the last quantization's scales (W' keeps the updated weights);
# GRID_HOLD: W' holds those rounded values. Measured variants (bench/compensation_cost.py)
GRID_STEPS: frozenset | None = None
GRID_HOLD = False
# a grid superblock walked GRID_PASSES times (0: per step, as above): each pass takes, for every
# step, the values libggml-base gave the superblock the previous pass left (the first: as the walk
# reached it), or with GRID_PASS_ROUND those values' scales and the torch rounding
GRID_PASSES = 0
GRID_PASS_ROUND = False
# the grid types whose step is rounded from a probe (:func:`grid_probe.probe_rounding`): the step's 32 columns
# of 8 rows side by side as one 256-wide row (the imatrix slice repeated), quantized by libggml-base
# (rows × 32 weights a step, not rows × 256). Measured (docs/lab/2026-12-05-grid-compensation.md):
# IQ2_XXS 1.008-1.021x the per-step walk's layer objective at 2.0-2.5x a plain candidate's cost
# (per step: 9.0-9.8x); IQ2_S 1.016-1.035x, IQ1_S 1.007-1.029x, IQ3_S 1.05-1.07x. None by default
# until the files' KLD on the benchmark says the ~1-2 % of layer error costs nothing.
PACKED: frozenset = frozenset()
# the "packed" sweep: the "fixed" sweep with every grid IQ type's step rounded from the probe. On
# the 1.5B benchmark model's own tensors (docs/lab/2026-12-06-compensation-on-real-tensors.md) it
# left 1.07x (IQ2_XXS) to 1.25x (IQ3_S) the per-step walk's layer error at 2.7x plain per menu
# (fixed: 8.8x): the probe's rounding is as good as the file's but not the file's (a sub-block's
# scale is coded against another ruler), so the walk passes on an error the file does not have
# PACKED_SWEEP and PACKED_RULED name the sweep's cache key (Compensation.digest) as they did when
# they were made; a type of PACKED_PROXY below is rounded by the proxy whichever of them holds it
PACKED_SWEEP = frozenset({"IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S"})
# the "ruled" sweep's: the grid IQ types whose ruler is max s / DIV (grid_probe.RULES, checked
# against libggml-base). IQ1_M refits its ruler over the whole superblock after coding the scales
# (a third stage the ruler does not follow: 1.0465x the per-step walk's error measured on a
# down_proj), so it is walked per step
RULED_SWEEP = frozenset(grid_probe.RULES) - {"IQ1_M"}
# the "packed" sweep's other grid types (IQ2_XS, IQ3_XXS: the probe's own ruler is not measured on
# them): walked as under "ruled", so no grid type but IQ1_M is quantized again at every step
PACKED_RULED = RULED_SWEEP - PACKED_SWEEP
PACK_NORM = "rms"  # a probe row's norm: its superblock's RMS ("max": its largest 32-column RMS; measured)
# the weights a probe's search uses (grid_probe.py): "probe", the imatrix slice repeated (the
# probe superblock's σ², not the row's); "row", each position weighted as its row's own superblock
# would weigh it, so the probe's grid choice is the row's
PACK_WEIGHTS = "probe"  # one of grid_probe.WEIGHT_MODES
# the "ruled", "fixed" and "packed" sweeps' superblocks of the types quants/recode.py writes (the
# K-quants, IQ4_XS): the candidate's bytes are the walk's codes written into the quantization
# each superblock had when the walk reached it (its scales, the codes each step rounded to), not
# libggml-base's quantization of W' again: the file holds the walk's rounding in every block (the
# quantization again gave it back in 83-99 % of 32-blocks on the 1.5B model's layer 1 and chose its
# scales anew), and the second quantization's cost is gone. False: the bytes are libggml-base's quantization of W' (a measured
# variant; bench/compensation_cost.py "packed-requant")
WRITE_CODES = True
# the "packed" sweep's grid types rounded by the proxy (proxy_rounding.py), as the "proxy" sweep
# rounds them: on the 1.5B benchmark model's tensors IQ3_XXS left 0.98x and IQ2_XXS 0.96x the
# ruled walk's layer error (the probe: 1.00x and 1.02x) at 1.67x and 1.96x a plain candidate's
# time (ruled 2.99x, 3.17x), docs/lab/2026-12-07-proxy-grid-types.md. The other grid types'
# proxies cost more than the probe on one CPU thread (IQ1_S 4.7x, IQ2_S 2.8x, IQ3_S 2.7x)
PACKED_PROXY = frozenset({"IQ3_XXS", "IQ2_XXS"})


# the proxy's held-level types whose superblock bytes the walk writes from the levels it chose
# (proxy_grids.WRITES: IQ3_XXS), not libggml-base's quantization of the held W': that quantization
# gives the held levels back to the bit (docs/lab/2026-12-07-proxy-grid-types.md), so it only
# cost about half a plain quantization's time (the bytes were equal on every problem the tests try)
WRITE_HELD = True


def held_writes() -> frozenset:
    """The held-level types whose bytes a proxied walk can write (proxy_grids.WRITES)."""
    from . import proxy_grids

    return proxy_grids.WRITES


def writes(q: qt.QType, B: int, proxy: bool = False) -> bool:
    """Whether the walk of `q` (blocks of `B`) writes the candidate's bytes itself (WRITE_CODES,
    WRITE_HELD)."""
    from . import fixed_rounding, proxy_grids, proxy_rounding

    if proxy:
        return bool(WRITE_HELD) and B > STEP and q.name in proxy_grids.WRITES and proxy_rounding.holds(q)
    return bool(WRITE_CODES) and B > STEP and q.name in fixed_rounding.SWEEP_TYPES and recode.supports(q)


def sweep_fixed(m: np.ndarray, q: qt.QType, imatrix, M, dead, lib, B: int,
                packed: frozenset = frozenset(), ruled: frozenset = frozenset(), *, proxy: bool = False,
                record: dict | None = None) -> tuple[np.ndarray, bytes | None]:
    """The "ruled", "fixed" and "packed" sweeps, in float32: W' for `m` with the error of every 32
    columns passed on, and the candidate's bytes where the walk wrote them (:func:`writes`; else
    None: the bytes are libggml-base's quantization of W').

    A superblock type of :data:`fixed_rounding.SWEEP_TYPES` (the K-quants, IQ4_XS) is quantized
    by libggml-base once per superblock, when the walk reaches it; its first 32-column step takes
    libggml's values, each later step is rounded with that quantization's scales held fixed
    (fixed_rounding.py), and W' holds the rounded values: a superblock of values the quantizer's
    scales represent exactly, which libggml-base quantizes back to (nearly) the same values, so
    the error passed on is the file's. A step of a `packed` or `ruled` type is rounded by
    libggml-base on a probe of 8 rows' step columns (:func:`grid_probe.probe_rounding`); for a
    `ruled` type, each of its superblocks is quantized when the walk reaches it (the first step's
    rounding) and the later steps' scales are coded against that superblock's ruler
    (:class:`grid_probe.SuperblockRuler`). Any other type (its block of 32, or a grid IQ
    superblock) is quantized by libggml-base at every step, as the "requant" sweep does; for
    these and the packed types W' holds the updated weights, and the row's last step (no later
    column to take its error) is not quantized.

    The walk goes a group at a time (the superblock, or :data:`LAZY` columns of 32-blocks), from
    M, the upper factor of H = M Mᵀ (:func:`compensate._reversed_factor`). With the columns
    before a group G fixed (Q their rounding), the best values of the columns still free are
    W + (W − Q)_before · M[before, free] · M[free, free]⁻¹ (minimizing the error tr(ΔW H ΔWᵀ)
    over them; H's blocks in M's terms), and a leading block of an upper triangular inverse is the
    inverse of the leading block, so G starts from W_G + C_G · M_GG⁻¹, where C_G accumulates
    (W − Q)_S · M[S, G] over the groups S already walked (one product per group). Within G the
    steps are GPTQ's with U_GG = M_GG⁻¹, the diagonal block of the Cholesky factor of H⁻¹
    (Frantar et al.): no n × n inverse is formed (the LDLQ form of the same update, Chee et al.,
    QuIP). The GRID_* settings are the measured variants the product does not use
    (bench/compensation_cost.py sets them). With `proxy`, the types of
    :data:`proxy_rounding.TYPES` are rounded by proxy_rounding.py instead of libggml-base: a
    32-block by :func:`proxy_rounding.round_q8_0`, a K-quant superblock's steps at the scales of
    :class:`proxy_rounding.KQuantScales` (held, as "fixed" holds libggml's), a grid superblock's
    by :func:`proxy_rounding.grid_proxy`'s (held where :func:`proxy_rounding.holds`)."""
    import torch

    from . import fixed_rounding  # lazy: it imports torch, which building plain candidates never needs
    from . import proxy_rounding

    rows, n = m.shape
    with warnings.catch_warnings():  # `m` may be a read-only map of the weights: W0 is only ever read
        warnings.filterwarnings("ignore", message="The given NumPy array is not writable")
        W0 = torch.from_numpy(m)
    out = torch.zeros(rows, n, dtype=torch.float32)  # C for the groups not yet walked, W' for the others
    live = torch.from_numpy(~dead).to(torch.float32)
    vec = None if imatrix is None else np.ascontiguousarray(imatrix, dtype=np.float32)
    step = min(B, STEP)
    group = B if B > STEP else max(B, LAZY)
    fixed = B > STEP and q.name in fixed_rounding.SWEEP_TYPES
    grid = B > STEP and not fixed and fixed_rounding.supports(q)
    steps = GRID_STEPS if grid and GRID_STEPS is not None else None
    hold = fixed or (steps is not None and GRID_HOLD)
    passes = int(GRID_PASSES) if grid else 0
    ruled = grid and q.name in ruled  # each in grid_probe.RULES
    pack = ruled or (grid and q.name in packed)
    ruler = None
    proxy = proxy and proxy_rounding.supports(q) and not passes and steps is None
    if proxy and (B == STEP) != (q.name == "Q8_0") or proxy and B > STEP and not (fixed or grid):
        raise QuantizationInputError(f"the proxy sweep has no superblock walk for {q.name}")
    vt = proxy_rounding.as_vector(vec, W0.device) if proxy else None
    held = proxy and grid and proxy_rounding.holds(q)  # W' holds values libggml gives back
    hold = hold or held
    write = writes(q, B, proxy)
    blocks = np.empty((rows, n // B, q.type_size), dtype=np.uint8) if write else None  # the bytes, a superblock at a time
    rec = None
    if record is not None:
        rec = torch.full((rows, n), float("nan"), dtype=torch.float32)
        record["rounding"] = rec.numpy()
    for g0 in range(0, n, group):
        g1 = min(n, g0 + group)
        Ug = torch.linalg.solve_triangular(M[g0:g1, g0:g1].double(), torch.eye(g1 - g0, dtype=torch.float64),
                                           upper=True).to(torch.float32)  # U_GG = M_GG⁻¹
        W = W0[:, g0:g1] + out[:, g0:g1] @ Ug if g0 else W0[:, g0:g1].clone()  # the group's columns, local
        vg = None if vec is None else vec[g0:g1]
        if passes:
            W, Q = _superblock_passes(W, q, vg, Ug, live[g0:g1], lib, passes, bool(GRID_PASS_ROUND))
        else:
            Q = torch.zeros(rows, g1 - g0, dtype=torch.float32)
            scales = None
            for c0 in range(0, g1 - g0, step):
                c1 = c0 + step
                if g0 + c1 == n and not hold:  # the row's last step: its error has no column to go to
                    break
                b0 = (c0 // B) * B  # the block holding the step, local
                if proxy and B == STEP:  # a 32-block: its step is the block
                    Qs = proxy_rounding.round_q8_0(W[:, c0:c1])
                elif proxy and fixed:
                    if c0 == b0:
                        scales = proxy_rounding.KQuantScales(W[:, b0:b0 + B], q, None if vt is None else vt[g0 + b0:g0 + b0 + B])
                    Qs = scales.round(W[:, c0:c1], c0 - b0, c1 - b0)
                elif proxy:
                    if c0 == b0:
                        ruler = proxy_rounding.grid_proxy(W[:, b0:b0 + B], q, None if vt is None else vt[g0 + b0:g0 + b0 + B])
                    Qs = ruler.round(c0 - b0, W[:, b0:b0 + B])
                elif scales is not None and (fixed or (c0 - b0) // step not in steps):
                    Qs = scales.round(W[:, c0:c1], c0 - b0, c1 - b0, keep=write)
                elif pack and ruled and c0 == b0:  # the walk reaches the superblock: quantized as it stands
                    ruler = grid_probe.SuperblockRuler(W[:, b0:b0 + B], q, None if vg is None else vg[b0:b0 + B], lib)
                    Qs = ruler.first[:, :step]
                elif pack:
                    sq = W[:, b0:b0 + B].square()
                    norm = (sq.mean(1, keepdim=True) if PACK_NORM == "rms" else
                            sq.reshape(rows, -1, step).mean(2).amax(1, keepdim=True)).sqrt()
                    norm = torch.where(norm > 0, norm, torch.ones_like(norm))
                    v = None if vg is None else vg[c0:c1]
                    ms = sq.mean(1) / norm.squeeze(1).square()  # the row's superblock's mean square, normalized
                    if ruled:
                        vals, code = grid_probe.probe_rounding(W[:, c0:c1] / norm, q, v, lib, B, ms, "row", codes=True)
                        Qs = ruler.round(c0 - b0, W[:, b0:b0 + B], code, vals * norm)
                    else:
                        Qs = grid_probe.probe_rounding(W[:, c0:c1] / norm, q, v, lib, B, ms, PACK_WEIGHTS) * norm
                else:
                    blk = np.ascontiguousarray(W[:, b0:b0 + B].numpy())
                    v = None if vg is None else vg[b0:b0 + B]
                    data = lib.quantize(blk, q, v, name="compensation", workers=1)
                    Qs = torch.from_numpy(lib.dequantize(data, q, blk.shape, name="compensation")[:, c0 - b0:c1 - b0])
                    if fixed or steps is not None:
                        scales = fixed_rounding.FixedScales(data, q, rows, B, v)
                E = (W[:, c0:c1] - Qs) * live[g0 + c0:g0 + c1]
                err = torch.linalg.solve_triangular(Ug[c0:c1, c0:c1], E, upper=True, left=False)
                if hold:
                    W[:, c0:c1] = ruler.held if held else Qs
                W[:, c1:] -= err @ Ug[c0:c1, c1:]
                Q[:, c0:c1] = Qs
                if rec is not None:
                    rec[:, g0 + c0:g0 + c1] = Qs
            if write:
                done = ruler if proxy else scales  # the superblock's rounding: its bytes
                blocks[:, g0 // B] = np.frombuffer(done.written(), dtype=np.uint8).reshape(rows, q.type_size)
        out[:, g0:g1] = W
        if g1 < n:
            out[:, g1:] += ((W0[:, g0:g1] - Q) * live[g0:g1]) @ M[g0:g1, g1:]
    return out.numpy(), (blocks.tobytes() if write else None)


def _superblock_passes(start, q: qt.QType, v, U, live, lib, passes: int, rnd: bool):
    """Walk a grid superblock `passes` times from `start` (rows × its width: the values it has
    when the walk reaches it), each pass's rounding taken from libggml-base's quantization of
    what the previous pass left; U is the group's block of the Cholesky factor of H⁻¹ and `live`
    its columns' mask. Returns the last pass's weights and rounding."""
    import torch

    from . import fixed_rounding  # lazy: it imports torch, which building plain candidates never needs

    rows, width = start.shape
    sb = start
    for _ in range(passes):
        blk = np.ascontiguousarray(sb.numpy())
        data = lib.quantize(blk, q, v, name="compensation", workers=1)
        D = None if rnd else torch.from_numpy(lib.dequantize(data, q, blk.shape, name="compensation"))
        scales = fixed_rounding.FixedScales(data, q, rows, width, v) if rnd else None
        sb = start.clone()
        Q = torch.empty(rows, width, dtype=torch.float32)
        for c0 in range(0, width, STEP):
            c1 = c0 + STEP
            Q[:, c0:c1] = scales.round(sb[:, c0:c1], c0, c1) if rnd else D[:, c0:c1]
            E = (sb[:, c0:c1] - Q[:, c0:c1]) * live[c0:c1]
            err = torch.linalg.solve_triangular(U[c0:c1, c0:c1], E, upper=True, left=False)
            sb[:, c1:] -= err @ U[c0:c1, c1:]
    return sb, Q
