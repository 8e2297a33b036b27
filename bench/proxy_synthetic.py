"""The "proxy" compensation sweep against "ruled" (and any other sweep) on the synthetic problem of
tests/test_compensate._problem (rows × cols weights, X of 4,096 correlated tokens, imatrix mean x²),
one thread, times in process CPU seconds (a neighbour's load does not enter them).

Per seed, type and sweep, as Markdown: the candidate's time (the walk and libggml-base's
quantization of W') ÷ the plain candidate's, the output error ‖(W − Ŵ)X‖² of the file's bytes ÷
plain and ÷ the first sweep's, and the fraction of 32-blocks (of the steps the walk rounded) the
file holds as the walk rounded them: to the bit, and within 1e-3 of the block's largest. Then the
geometric mean over seeds. The factor of H is computed before the timing (shared by the types).
Each type's tables (libggml-base's, the proxy's lattice) are built before its timing.

With --fixed_points, first, per grid type: the fraction of 32-blocks of libggml-base's own
quantization that quantizing its dequantized output again (same imatrix) leaves as they are, and,
for the held-level proxy's types (candidates/proxy_grids.py), the fraction given back when W' holds
each value's level times its coded scale over stage 2's fudge factor.

    nice -n 19 env OMP_NUM_THREADS=1 .venv/bin/python bench/proxy_synthetic.py \\
        --types Q8_0,Q5_K,IQ3_S,IQ2_S,IQ2_XXS,IQ1_S,IQ3_XXS --sweeps ruled,packed,proxy --seeds 0,1,2
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))

from test_compensate import _out_err, _problem  # noqa: E402

from voodoo_quant.candidates import compensate, grid_probe, proxy_grids  # noqa: E402
from voodoo_quant.core import ggml  # noqa: E402
from voodoo_quant.core import qtypes as qt  # noqa: E402
from voodoo_quant.quants import decompose  # noqa: E402


def blocks_same(A: np.ndarray, B: np.ndarray) -> tuple[float, float]:
    """Fractions of 32-blocks of A equal to B's to the bit, and within 1e-3 of B's largest."""
    a, b = A.reshape(-1, 32), B.reshape(-1, 32)
    near = np.abs(a - b).max(1) <= 1e-3 * np.abs(b).max(1)
    return float((a == b).all(1).mean()), float(near.mean())


def fixed_points(W, imx, lib) -> None:
    import torch

    print("\n| type | own output quantized again: same | held levels given back: same | within 1e-3 |")
    print("|---|---:|---:|---:|")
    for q in grid_probe.RULES:
        data = lib.quantize(W, q, imx, workers=1)
        D = lib.dequantize(data, q, W.shape)
        own = blocks_same(lib.dequantize(lib.quantize(D, q, imx, workers=1), q, W.shape), D)[0]
        held = ("–", "–")
        if q in proxy_grids.SPECS:
            spec = proxy_grids.SPECS[q]
            a = decompose(torch.frombuffer(bytearray(data), dtype=torch.uint8), qt.get(q), W.shape)
            code = a.code.float().reshape(W.shape)
            scale = a.scale.unsqueeze(-1).expand(a.code.shape).reshape(W.shape)
            if q == "IQ1_S":  # decompose's IQ1 code is 8·(g + δ), its scale fp32(d·(2l + 1))/8
                code, scale = code / 8, scale * 8
            H = (scale / spec.kappa / spec.fudge * grid_probe.levels(code, qt.get(q))).numpy()
            held = tuple(f"{v:.3f}" for v in blocks_same(lib.dequantize(lib.quantize(H, q, imx, workers=1), q, W.shape), D))
        print(f"| {q} | {own:.3f} | {held[0]} | {held[1]} |", flush=True)


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", type=int, default=256)
    ap.add_argument("--cols", type=int, default=1536)
    ap.add_argument("--types", default="Q8_0,Q5_K,IQ3_S,IQ2_S,IQ2_XXS,IQ1_S")
    ap.add_argument("--sweeps", default="ruled,proxy", help=f"of {','.join(compensate.SWEEPS)}; the first is the reference")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--damp", type=float, default=compensate.DEFAULT_DAMP)
    ap.add_argument("--fixed_points", action="store_true")
    ap.add_argument("--out", type=Path, default=None, help="write every measurement here (JSON)")
    a = ap.parse_args(argv)
    types, sweeps = a.types.split(","), a.sweeps.split(",")
    torch.set_num_threads(1)
    lib = ggml.lib()
    rows: list[dict] = []
    for seed in (int(s) for s in a.seeds.split(",")):
        W, X, H, imx = _problem(rows=a.rows, n=a.cols, seed=seed)
        if a.fixed_points and seed == int(a.seeds.split(",")[0]):
            fixed_points(W, imx, lib)
        comps = {s: compensate.Compensation(H, a.damp, s) for s in sweeps}
        for c in comps.values():
            c.factor()
        print(f"\n| seed | type | sweep | time ÷ plain | error ÷ plain | ÷ {sweeps[0]} | same | ≤ 1e-3 |")
        print("|---:|---|---|---:|---:|---:|---:|---:|")
        for q in types:
            lib.quantize(W[:4, :256].copy(), q, imx[:256].copy(), workers=1)  # its tables, untimed
            if q in proxy_grids.SPECS:
                b = torch.from_numpy(W[:4, :256].copy())
                proxy_grids.HeldLevelProxy(b, q, torch.from_numpy(imx[:256].copy())).round(0, b)
            t = time.process_time()
            data = lib.quantize(W, q, imx, workers=1)
            row = {"seed": seed, "type": q, "plain_s": time.process_time() - t, "plain_err": _out_err(W, data, q, X)}
            for s in sweeps:
                rec: dict = {}
                t = time.process_time()
                Wp, data = compensate.compensated(W, q, imx, comps[s], lib, record=rec)
                if data is None:  # the candidate's bytes: libggml-base's of W', unless the walk wrote them
                    data = lib.quantize(np.ascontiguousarray(Wp), q, imx, workers=1)
                secs = time.process_time() - t
                R, F = rec["rounding"].reshape(-1, 32), lib.dequantize(data, q, W.shape).reshape(-1, 32)
                done = ~np.isnan(R).any(1)
                same, near = blocks_same(F[done], R[done])
                row[s] = {"s": secs, "err": _out_err(W, data, q, X), "same": same, "near": near}
            rows.append(row)
            for s in sweeps:
                r = row[s]
                print(f"| {seed} | {q} | {s} | {r['s'] / row['plain_s']:.2f} | {r['err'] / row['plain_err']:.4f} | "
                      f"{r['err'] / row[sweeps[0]]['err']:.4f} | {r['same']:.3f} | {r['near']:.3f} |", flush=True)
    print(f"\nGeometric means over seeds\n\n| type | sweep | time ÷ plain | error ÷ plain | ÷ {sweeps[0]} (range) | same | ≤ 1e-3 |")
    print("|---|---|---:|---:|---:|---:|---:|")
    gm = lambda v: float(np.exp(np.mean(np.log(v))))  # noqa: E731
    for q in types:
        sel = [r for r in rows if r["type"] == q]
        for s in sweeps:
            ref = [r[s]["err"] / r[sweeps[0]]["err"] for r in sel]
            print(f"| {q} | {s} | {gm([r[s]['s'] / r['plain_s'] for r in sel]):.2f} | "
                  f"{gm([r[s]['err'] / r['plain_err'] for r in sel]):.4f} | {gm(ref):.4f} ({min(ref):.4f}–{max(ref):.4f}) | "
                  f"{np.mean([r[s]['same'] for r in sel]):.3f} | {np.mean([r[s]['near'] for r in sel]):.3f} |")
    if a.out:
        from voodoo_quant.core import fileio

        fileio.write_text(a.out, json.dumps({"argv": sys.argv[1:], "rows": rows}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
