"""The compensation walk's factor: one Cholesky (today's form) against the Cholesky and the n × n
triangular inverse the walk needed while it read the whole inverse factor U = M⁻¹.

One process, one thread, side by side and alternating (a ratio, not a timing): for each input
width n, a damped SPD Hessian from correlated random activations; `Compensation.factor()` is timed
with the factor cache emptied, then the same plus the inverse the earlier form formed. The widths
default to the 1.5B benchmark model's layer inputs (1536: q/k/v, o, gate/up; 8960: down).

    OMP_NUM_THREADS=1 .venv/bin/python bench/compensation_factor.py --n 1536 8960
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.candidates import compensate  # noqa: E402
from voodoo_quant.candidates.compensate import Compensation  # noqa: E402


def hessian(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    X = rng.standard_normal((2 * n, n), dtype=np.float32) @ (np.eye(n, dtype=np.float32)
                                                            + 0.1 * rng.standard_normal((n, n), dtype=np.float32))
    X *= np.exp(rng.standard_normal(n, dtype=np.float32))
    return (X.T @ X).astype(np.float32)


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--n", type=int, nargs="+", default=[1536, 8960])
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    rows = []
    for n in a.n:
        comp = Compensation(hessian(n, n), compensate.DEFAULT_DAMP)
        chol, both = [], []
        for _ in range(a.repeats):
            compensate.release_factors()
            chol.append(timed(comp.factor))

            def earlier():
                compensate.release_factors()
                M, _ = comp.factor()
                torch.linalg.solve_triangular(M.double(), torch.eye(n, dtype=torch.float64), upper=True)

            both.append(timed(earlier))
        compensate.release_factors()
        row = {"n": n, "cholesky_s": min(chol), "cholesky_and_inverse_s": min(both),
               "ratio": min(chol) / min(both)}
        rows.append(row)
        print(f"n {n:>6}: one Cholesky {row['cholesky_s']:.2f} s, with the n×n inverse {row['cholesky_and_inverse_s']:.2f} s"
              f" → {row['ratio']:.2f}×", flush=True)
    if a.out:
        a.out.write_text(json.dumps({"threads": 1, "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
