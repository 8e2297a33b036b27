"""bench/code_descent.py: coordinate descent on codes with the scales fixed."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import torch

BENCH = Path(__file__).resolve().parents[1] / "bench"


def _module():
    sys.path.insert(0, str(BENCH))
    spec = importlib.util.spec_from_file_location("code_descent", BENCH / "code_descent.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _problem(seed: int, rows: int = 24, n: int = 64, correlated: bool = True):
    g = torch.Generator().manual_seed(seed)
    W = torch.randn(rows, n, generator=g, dtype=torch.float64)
    X = torch.randn(512, n, generator=g, dtype=torch.float64)
    if correlated:
        X = X @ (torch.eye(n, dtype=torch.float64) + 0.5 * torch.randn(n, n, generator=g, dtype=torch.float64))
    H = X.T @ X / X.shape[0]
    scale = torch.full((rows, n), 0.25, dtype=torch.float64)
    offset = torch.zeros(rows, n, dtype=torch.float64)
    return W, H, scale, offset


def test_descent_lowers_the_layer_objective_and_keeps_codes_on_the_grid():
    cd = _module()
    grid = torch.arange(-8, 8, dtype=torch.float64)  # Q4_0's codes
    W, H, scale, offset = _problem(0)
    rtn = torch.clamp(torch.round(W / scale), -8, 7)
    C, before, after = cd.descend(W, H, scale, offset, rtn, grid, sweeps=3)
    assert after < 0.95 * before  # correlated inputs: round-to-nearest is far from the best codes
    assert bool(torch.isin(C, grid).all())
    E = W - scale * C
    assert abs(float(((E @ H) * E).sum()) - after) < 1e-9 * before


def test_with_uncorrelated_inputs_round_to_nearest_is_already_optimal():
    cd = _module()
    grid = torch.arange(-8, 8, dtype=torch.float64)
    W, _, scale, offset = _problem(1)
    H = torch.diag(torch.rand(W.shape[1], dtype=torch.float64) + 0.1)  # separable objective
    rtn = torch.clamp(torch.round(W / scale), -8, 7)
    C, before, after = cd.descend(W, H, scale, offset, rtn, grid, sweeps=2)
    assert torch.equal(C, rtn) and after == before


def test_a_codebook_grid_moves_between_its_own_values():
    cd = _module()
    grid = torch.tensor([-127, -104, -83, -65, -49, -35, -22, -10, 1, 13, 25, 38, 53, 69, 89, 113], dtype=torch.float64)
    W, H, _, offset = _problem(2)
    scale = torch.full_like(W, 1 / 64)
    start = grid[torch.argmin((W.unsqueeze(-1) / scale.unsqueeze(-1) - grid).abs(), dim=-1)]
    C, before, after = cd.descend(W, H, scale, offset, start, grid, sweeps=2)
    assert after < before and bool(torch.isin(C, grid).all())
