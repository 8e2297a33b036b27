"""The Hessians' products (training/hessians.py): the upper block triangle of xᵀx summed batch by
batch and mirrored once is Σ xᵀx to float32 rounding, exactly symmetric, at (B+1)/(2B) of the
full product's flops; and the block rule the time model prices it by is the one it runs by."""

from __future__ import annotations

import pytest
import torch


def _gram(n: int, batches: list[int], seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    from voodoo_quant.training.hessians import add_gram_upper, mirror_upper

    g = torch.Generator().manual_seed(seed)
    mix = torch.randn(n, n, generator=g) / n ** 0.5 + torch.eye(n)  # correlated columns, as activations are
    xs = [torch.randn(t, n, generator=g) @ mix + 0.5 for t in batches]
    acc = torch.zeros(n, n)
    for x in xs:
        add_gram_upper(acc, x)
    ref = sum(x.double().T @ x.double() for x in xs)
    return mirror_upper(acc), ref


@pytest.mark.parametrize("n,batches", [(1, [3]), (7, [5, 2]), (300, [16, 16, 9]), (1535, [8]),
                                       (1536, [12, 4]), (1601, [6, 6]), (2309, [5, 9, 1])])
def test_triangle_sum_is_the_full_gram_exactly_symmetric(n, batches):
    h, ref = _gram(n, batches)
    assert h.dtype == torch.float32 and h.shape == (n, n)
    assert torch.equal(h, h.T)
    tol = 2e-6 * sum(batches) * float(torch.diagonal(ref).max())  # float32 sums of that many products
    assert float((h.double() - ref).abs().max()) <= tol


def test_the_blocks_below_the_diagonal_are_not_computed():
    from voodoo_quant.training.hessians import add_gram_upper, gram_edges

    n = 2309
    e = gram_edges(n)
    assert len(e) > 2
    acc = add_gram_upper(torch.zeros(n, n), torch.randn(4, n) + 1)
    for i, (a, b) in enumerate(zip(e[:-1], e[1:])):
        assert bool((acc[b:, a:b] == 0).all())  # below block i's diagonal block: left for the mirror
        assert bool((acc[a:b, a:] != 0).all())


def test_the_mirror_is_in_place_and_idempotent():
    from voodoo_quant.training.hessians import mirror_upper

    h, _ = _gram(1601, [4])
    before = h.clone()
    assert mirror_upper(h) is h and torch.equal(h, before)


def test_the_same_inputs_give_the_same_bytes():
    a, _ = _gram(1601, [7, 3], seed=5)
    b, _ = _gram(1601, [7, 3], seed=5)
    assert a.numpy().tobytes() == b.numpy().tobytes()


@pytest.mark.parametrize("n", [1, 100, 767, 768, 1535, 1536, 1601, 2309, 4095, 8960, 17408])
def test_block_rule_and_its_flops(n):
    from voodoo_quant.memory import timing as tm
    from voodoo_quant.training.hessians import GRAM_BLOCK, gram_edges, gram_flops

    e = gram_edges(n)
    B = len(e) - 1
    widths = [b - a for a, b in zip(e[:-1], e[1:])]
    assert e[0] == 0 and e[-1] == n and max(widths) - min(widths) <= 1
    assert B == 1 if n < 2 * GRAM_BLOCK else GRAM_BLOCK <= min(widths) and max(widths) < 2 * GRAM_BLOCK
    full = 2.0 * 64 * n * n
    assert gram_flops(64, n) == pytest.approx(full * (B + 1) / (2 * B), rel=1e-3)
    if n % B == 0:
        assert gram_flops(64, n) == full * (B + 1) / (2 * B)
    assert tm.hessian_flops(64, [n, n]) == 2 * gram_flops(64, n)


def test_the_hook_accumulates_the_triangle_and_finished_mirrors_it():
    from voodoo_quant.training.hessians import accumulating_hook, finished

    lin = torch.nn.Linear(1601, 3, bias=False)
    acc: dict[str, torch.Tensor] = {}
    h = lin.register_forward_hook(accumulating_hook(acc, "x"))
    xs = [torch.randn(2, 3, 1601) for _ in range(2)]
    with torch.no_grad():
        for x in xs:
            lin(x)
    h.remove()
    assert not torch.equal(acc["x"], acc["x"].T)  # the triangle, until finished
    H = finished(acc["x"])
    x = torch.cat([x.reshape(-1, 1601) for x in xs]).double()
    ref = (x.T @ x).numpy()
    assert (H == H.T).all() and abs(H - ref).max() <= 1e-5 * abs(ref).max()
