"""Candidates kept as int8 codes (compact.CompactCandidates) and the native mixing kernel:
every quantized type's affine form reproduces libggml-base bit for bit, the mixture is the
sequential float32 sum bit for bit, the gate gradients are the float64 dot products to float32
accuracy and do not depend on the thread count, and whatever cannot be held exactly falls back
to a float32 stack."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from voodoo_quant import quants
from voodoo_quant.candidates import mixkernel
from voodoo_quant.candidates.compact import CompactCandidates
from voodoo_quant.core import ggml
from voodoo_quant.core import qtypes as qt
from voodoo_quant.quants.random_blocks import random_blocks
from voodoo_quant.selection.menus import Menu
from voodoo_quant.student.build import IdentityLayout, TensorPlan, build_mixed

pytestmark = pytest.mark.skipif(mixkernel.load() is None, reason=f"mixing kernel unavailable: {mixkernel.unavailable_reason()}")

QUANTIZED = [n for n in quants.supported_types() if not qt.get(n).is_float]
ROWS, COLS = 24, 512


class _RowLayout(IdentityLayout):
    """A row permutation (what the converter does to llama's q/k projections): the GGUF's row r is
    the HF tensor's row perm[r]."""

    def __init__(self, shape, perm):
        super().__init__(None, shape)
        self.perm = torch.as_tensor(perm)

    @property
    def is_identity(self):
        return False

    def from_gguf(self, m):
        out = torch.empty_like(m.reshape(self.shape))
        out[self.perm] = m.reshape(self.shape)
        return out


class _TransposedLayout:
    """GGUF (ROWS, COLS) rows are the HF (COLS, ROWS) tensor's columns: sub-blocks run down columns."""
    gguf_name = None
    rows, n_per_row = ROWS, COLS

    def from_gguf(self, m):
        return m.reshape(ROWS, COLS).T.contiguous()


def _plan(types, layout=None, shape=(ROWS, COLS)):
    layout = layout or IdentityLayout(None, shape)
    sizes = tuple(qt.get(t).row_bytes(layout.n_per_row) * layout.rows for t in types)
    return TensorPlan("w", tuple(shape), "other", layout, Menu(tuple(types), tuple(types)), sizes, [])


def _blobs(plan, seed=0):
    g = torch.Generator().manual_seed(seed)
    m = torch.randn(plan.rows, plan.n_per_row, generator=g).numpy()
    imat = (np.abs(np.random.default_rng(seed).standard_normal(plan.n_per_row)) + 0.1).astype(np.float32)
    return [ggml.lib().quantize(m, t, imat, name="w") for t in plan.menu.types]


def _dense(plan, blobs):
    return [plan.dequantize(b, t) for b, t in zip(blobs, plan.menu.types)]


def _loop_mix(dense, p):
    out = None
    for k, d in enumerate(dense):
        t = d.clone().mul_(p[k])
        out = t if out is None else out.add_(t)
    return out


def _bits(t):
    return t.contiguous().view(torch.int32)


@pytest.mark.parametrize("name", QUANTIZED)
def test_every_quantized_type_has_int8_codes_that_expand_to_ggml(ggml_lib, name):
    q = qt.get(name)
    blob = torch.from_numpy(random_blocks(q, 64, np.random.default_rng(3)).reshape(-1).copy())
    shape = (1, 64 * q.block)
    a = quants.decompose(blob, name, shape)
    assert a is not None
    codes = a.code.float()
    assert torch.equal(codes, codes.round()) and codes.min() >= -128 and codes.max() <= 127
    assert a.sub_len >= 8 and a.sub_len & (a.sub_len - 1) == 0
    want = ggml_lib.dequantize(bytes(blob.numpy()), name, shape)
    assert np.array_equal(quants.expand(a).reshape(shape).numpy().view(np.uint32), want.view(np.uint32))


def test_float_types_have_no_affine_form():
    blob = torch.zeros(2 * 32 * 2, dtype=torch.uint8)
    assert quants.decompose(blob, "F16", (2, 32)) is None


@pytest.mark.parametrize("layout", ["identity", "rows"])
def test_compact_candidates_reproduce_ggml_in_hf_layout(layout):
    types = ("Q8_0", "Q6_K", "Q5_1", "Q4_K", "IQ4_XS", "Q3_K", "Q2_K", "IQ2_S", "IQ1_S")
    lay = None if layout == "identity" else _RowLayout((ROWS, COLS), torch.randperm(ROWS, generator=torch.Generator().manual_seed(1)))
    plan = _plan(types, lay)
    blobs = _blobs(plan)
    dense = _dense(plan, blobs)
    cc = CompactCandidates.build(plan, blobs, dense)
    assert cc is not None and cc.k == len(types)
    for k, d in enumerate(dense):
        assert torch.equal(_bits(cc(k)), _bits(d)), types[k]
    assert cc.nbytes < 0.4 * sum(d.numel() * 4 for d in dense)  # codes + scales, not float32


def test_layouts_that_split_sub_blocks_and_float_rungs_keep_a_float_stack():
    plan = _plan(("Q8_0", "Q4_0"), _TransposedLayout(), shape=(COLS, ROWS))
    blobs = _blobs(plan)
    assert CompactCandidates.build(plan, blobs, _dense(plan, blobs)) is None
    with_f16 = _plan(("Q8_0", "F16"))
    blobs = _blobs(with_f16)
    assert CompactCandidates.build(with_f16, blobs, _dense(with_f16, blobs)) is None
    mq = build_mixed(with_f16, blobs, lazy=False, dtype=torch.float32)
    assert mq.stacked is not None  # the float32 stack, as before


def test_a_wrong_code_is_caught_by_the_bit_check(monkeypatch):
    plan = _plan(("Q8_0", "Q4_0"))
    blobs = _blobs(plan)
    dense = _dense(plan, blobs)
    dense[1] = dense[1].clone()
    dense[1].view(-1)[5] += 1.0  # as if the affine form of one rung were wrong somewhere
    assert CompactCandidates.build(plan, blobs, dense) is None


def test_mixture_is_the_sequential_float32_sum_bit_for_bit_and_writes_the_buffer():
    plan = _plan(("Q8_0", "Q6_K", "Q5_1", "Q4_K", "IQ4_NL", "Q2_K"))
    blobs = _blobs(plan, seed=4)
    dense = _dense(plan, blobs)
    cc = CompactCandidates.build(plan, blobs, dense)
    g = torch.Generator().manual_seed(5)
    for _ in range(3):
        p = torch.softmax(torch.randn(cc.k, generator=g) * 3, 0)
        assert torch.equal(_bits(cc.mix(p)), _bits(_loop_mix(dense, p)))
    buf = torch.full(plan.shape, float("nan"))
    out = cc.mix(p, buf)
    assert out.data_ptr() == buf.data_ptr() and torch.equal(_bits(buf), _bits(_loop_mix(dense, p)))


def test_gate_gradient_matches_float64_and_ignores_the_thread_count():
    plan = _plan(("Q8_0", "Q5_0", "Q4_K", "IQ3_S"), shape=(40, 1024), layout=IdentityLayout(None, (40, 1024)))
    blobs = _blobs(plan, seed=6)
    dense = _dense(plan, blobs)
    cc = CompactCandidates.build(plan, blobs, dense)
    grad_w = torch.randn(plan.shape, generator=torch.Generator().manual_seed(7))
    want = torch.stack([(grad_w.double() * d.double()).sum() for d in dense])
    threads = torch.get_num_threads()
    try:
        got = {}
        for n in (1, 2, 3):
            torch.set_num_threads(n)
            got[n] = cc.grad(grad_w)
    finally:
        torch.set_num_threads(threads)
    assert torch.equal(got[1], got[2]) and torch.equal(got[1], got[3])
    scale = float((grad_w.double().abs() * torch.stack(dense).double().abs().amax(0)).sum())
    assert float((got[1] - want).abs().max()) < 1e-6 * scale


def test_switched_off_by_the_environment_variable(monkeypatch):
    plan = _plan(("Q8_0", "Q4_0"))
    blobs = _blobs(plan)
    assert isinstance(build_mixed(plan, blobs, lazy=False, dtype=torch.float32)._get, CompactCandidates)
    monkeypatch.setenv("VOODOO_MIX_KERNEL", "0")
    assert build_mixed(plan, blobs, lazy=False, dtype=torch.float32).stacked is not None
    monkeypatch.setenv("VOODOO_MIX_KERNEL", "2")
    from voodoo_quant.core.errors import EnvironmentVarError

    with pytest.raises(EnvironmentVarError):
        mixkernel.load()


def test_a_deep_copy_mixes_from_its_own_tensors():
    import copy

    plan = _plan(("Q8_0", "Q4_K"))
    blobs = _blobs(plan, seed=8)
    dense = _dense(plan, blobs)
    cc = CompactCandidates.build(plan, blobs, dense)
    twin = copy.deepcopy(cc)
    for c in cc.codes:
        c.zero_()  # the original's codes change; the copy must not see it
    p = torch.tensor([0.25, 0.75])
    assert torch.equal(_bits(twin.mix(p)), _bits(_loop_mix(dense, p)))
    assert not torch.equal(_bits(cc.mix(p)), _bits(_loop_mix(dense, p)))


def test_where_the_compiler_refuses_the_flags_a_portable_build_gives_the_same_bits(monkeypatch, tmp_path):
    """Apple clang has no -fopenmp: the kernel is then built single-threaded and generic, and the
    mixture is still the sequential sum bit for bit."""
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path))
    monkeypatch.setattr(mixkernel, "FLAGS", ("-fno-such-flag-anywhere", *mixkernel.PORTABLE_FLAGS))
    monkeypatch.setattr(mixkernel, "_loaded", None)
    monkeypatch.setattr(mixkernel, "_failure", None)
    lib = mixkernel.load()
    assert lib is not None and len(list((tmp_path / "kernels").glob("mix-*.so"))) == 1
    plan = _plan(("Q8_0", "Q5_1", "Q3_K", "IQ2_S"))
    blobs = _blobs(plan, seed=9)
    dense = _dense(plan, blobs)
    cc = CompactCandidates.build(plan, blobs, dense)
    assert cc is not None and cc._lib is lib
    p = torch.softmax(torch.arange(4.0), 0)
    assert torch.equal(_bits(cc.mix(p)), _bits(_loop_mix(dense, p)))


def test_no_compiler_keeps_float_stacks_and_says_why(monkeypatch):
    monkeypatch.setattr(mixkernel, "_compiler", lambda: None)
    monkeypatch.setattr(mixkernel, "_loaded", None)
    monkeypatch.setattr(mixkernel, "_failure", None)
    plan = _plan(("Q8_0", "Q4_0"))
    assert build_mixed(plan, _blobs(plan), lazy=False, dtype=torch.float32).stacked is not None
    assert "no C compiler" in mixkernel.unavailable_reason()
