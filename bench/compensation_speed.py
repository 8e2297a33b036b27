"""Compensated candidate build: the factor kept across a tensor's types vs computed per type.

Side by side in one process, alternating (a ratio, not a timing): for each tensor shape of
SmolLM2-135M's decoder layer (576 × 576, 576 × 1536, 1536 × 576 as GGUF rows × columns), every
type of the benchmark menu (its fallbacks for a 576-wide row) is compensated with and without the per-process factor cache.

    .venv/bin/python bench/compensation_speed.py
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.candidates import compensate  # noqa: E402
from voodoo_quant.candidates.compensate import Compensation, compensated_matrix  # noqa: E402

MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_XS", "IQ4_NL", "Q3_K", "IQ3_S", "IQ2_S")
NARROW = ("Q8_0", "Q5_1", "Q5_0", "IQ4_NL", "Q4_0")  # what llama-quantize's fallbacks leave a 576-wide row


def build(W, comp, vec, cache: bool) -> float:
    compensate._FACTORS.clear()
    saved = compensate.FACTOR_CACHE_BYTES
    compensate.FACTOR_CACHE_BYTES = saved if cache else -1
    try:
        t0 = time.perf_counter()
        for q in (MENU if W.shape[1] % 256 == 0 else NARROW):
            compensated_matrix(W, q, vec, comp)
        return time.perf_counter() - t0
    finally:
        compensate.FACTOR_CACHE_BYTES = saved


def main() -> None:
    rng = np.random.default_rng(0)
    print(f"{'rows × n':>12}  {'per type (s)':>12}  {'kept (s)':>9}  ratio")
    for rows, n in ((576, 576), (1536, 576), (576, 1536)):
        X = rng.normal(size=(2 * n, n)) * np.exp(rng.normal(0, 0.7, n))
        comp = Compensation((X.T @ X).astype(np.float32))
        W = rng.normal(0, 0.02, (rows, n)).astype(np.float32)
        vec = (X ** 2).mean(0).astype(np.float32)
        build(W, comp, vec, True)  # warm the library's IQ tables
        off = min(build(W, comp, vec, False) for _ in range(2))
        on = min(build(W, comp, vec, True) for _ in range(2))
        print(f"{rows:>5} × {n:<5}  {off:12.2f}  {on:9.2f}  {on / off:.2f}")


if __name__ == "__main__":
    main()
