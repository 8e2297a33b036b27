"""Torch dequantization kernels (``--lazy``) against libggml-base's ``to_float``, bit for bit.

Every kernel is compared with ggml on random blocks (random code bytes are adversarial for
free) and on adversarial ones (zero, all-max, subnormal and -0.0 scales), for several shapes,
as float32 bit patterns (stricter than ``torch.equal``, which calls -0.0 equal to 0.0) and with
``torch.equal``. The IQ tables read out of the library are checked against the independent
copies in llama.cpp's own gguf-py.
"""

from __future__ import annotations

import zlib

import numpy as np
import pytest
import torch

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import QuantizationInputError, UnknownQuantTypeError
from voodoo_quant.quants import PackedTensor, _registry, dequantize, grids, supported_types
from voodoo_quant.quants.random_blocks import MODES, random_blocks

# The default menus' types plus the optional ones; each must have a kernel.
REQUIRED = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ4_NL", "IQ3_S", "IQ2_S",
            "IQ2_XXS", "IQ1_S", "Q5_0", "Q5_1", "Q4_0", "Q4_1", "F16", "BF16", "F32", "IQ3_XXS",
            "IQ2_XS", "IQ1_M", "MXFP4")
TYPES = supported_types()
SHAPES_256 = ((8, 512), (3, 256), (2, 3, 256))
SHAPES_32 = ((8, 512), (5, 96), (1, 32), (2, 3, 64))


def _shapes(name: str) -> tuple[tuple[int, ...], ...]:
    return SHAPES_256 if qt.get(name).block == 256 else SHAPES_32


def _assert_bit_exact(ggml_out: np.ndarray, ours: torch.Tensor, what: str) -> None:
    assert ours.dtype == torch.float32 and tuple(ours.shape) == ggml_out.shape, what
    ref = torch.from_numpy(np.ascontiguousarray(ggml_out))
    ref_bits, our_bits = ref.view(torch.int32), ours.contiguous().view(torch.int32)
    if not torch.equal(ref_bits, our_bits):
        bad = (ref_bits != our_bits).reshape(-1)
        i = int(bad.nonzero()[0])
        diff = (ref.reshape(-1) - ours.reshape(-1)).abs().nan_to_num(float("inf"))
        worst = int(torch.where(bad, diff, torch.tensor(-1.0)).argmax())  # among the differing ones
        pytest.fail(
            f"{what}: {int(bad.sum())} of {bad.numel()} values differ; first at flat index {i}: "
            f"ggml {ref.reshape(-1)[i].item()!r} vs torch {ours.reshape(-1)[i].item()!r}; "
            f"worst at {worst}: ggml {ref.reshape(-1)[worst].item()!r} vs torch {ours.reshape(-1)[worst].item()!r}"
        )
    assert torch.equal(ref, ours), what


def _check(ggml_lib, name: str, shape: tuple[int, ...], blocks: np.ndarray, what: str) -> None:
    data = blocks.reshape(-1)
    assert ggml_lib.validate_bytes(data.tobytes(), name), f"{what}: generated invalid {name} bytes"
    ref = ggml_lib.dequantize(data, name, shape)
    _assert_bit_exact(ref, dequantize(torch.from_numpy(data.copy()), name, shape), what)


def _n_blocks(name: str, shape: tuple[int, ...]) -> int:
    return int(np.prod(shape)) // qt.get(name).block


def test_every_required_type_has_a_kernel():
    missing = [t for t in REQUIRED if t not in TYPES]
    assert not missing, f"no torch kernel for {missing}"


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("name", TYPES)
def test_kernel_bit_exact_with_ggml(ggml_lib, name, mode):
    rng = np.random.default_rng(zlib.crc32(f"{name}/{mode}".encode()))
    for shape in _shapes(name):
        blocks = random_blocks(name, _n_blocks(name, shape), rng, mode)
        _check(ggml_lib, name, shape, blocks, f"{name} {mode} {shape}")


@pytest.mark.parametrize("name", TYPES)
def test_kernel_bit_exact_on_many_blocks(ggml_lib, name):
    # 2048 random blocks: every grid entry (≤ 2048 of them, ≥ 32 lookups per block) is hit
    # with overwhelming probability, and every sub-scale / sign pattern with it.
    rng = np.random.default_rng(12345)
    q = qt.get(name)
    shape = (2048, q.block) if q.block > 1 else (64, 512)
    _check(ggml_lib, name, shape, random_blocks(name, _n_blocks(name, shape), rng), f"{name} many blocks")


QUANTIZABLE = ("Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "Q5_1", "Q5_0", "Q4_1", "Q4_0",
               "IQ4_NL", "IQ4_XS", "MXFP4", "F16", "BF16")


@pytest.mark.parametrize("name", QUANTIZABLE)
def test_kernel_on_real_quantized_weights(ggml_lib, name):
    """Bytes the C quantizer writes (with an imatrix where the type takes one) decode the same."""
    rng = np.random.default_rng(7)
    w = (rng.standard_normal((8, 512)) * rng.uniform(0.001, 3.0, (8, 1))).astype(np.float32)
    w[0, :64] = 0.0  # an all-zero block
    w[1, :32] *= 1e4  # an outlier block
    imatrix = rng.uniform(0.1, 2.0, 512).astype(np.float32)
    for im in (None, imatrix):
        data = ggml_lib.quantize(w, name, im)
        ref = ggml_lib.dequantize(data, name, w.shape)
        packed = PackedTensor.from_bytes(data, name, w.shape)
        _assert_bit_exact(ref, packed.dequantize(), f"{name} quantized (imatrix={im is not None})")


# -- the IQ tables read out of libggml-base ------------------------------------------------------

@pytest.mark.parametrize("table, cls", [
    ("iq2xxs_grid", "IQ2_XXS"), ("iq2xs_grid", "IQ2_XS"), ("iq2s_grid", "IQ2_S"),
    ("iq3xxs_grid", "IQ3_XXS"), ("iq3s_grid", "IQ3_S"), ("iq1s_grid", "IQ1_S"),
])
def test_grids_match_vendored_gguf_py(vendored_gguf_quants, table, cls):
    ref = getattr(vendored_gguf_quants, cls)
    ref.init_grid()
    ours = grids.numpy_table(table)
    assert ours.shape == tuple(ref.grid_shape)
    np.testing.assert_array_equal(ours, ref.grid.reshape(ref.grid_shape).astype(np.float32))


def test_small_tables_match_vendored_gguf_py(vendored_gguf_quants):
    g = vendored_gguf_quants
    np.testing.assert_array_equal(grids.numpy_table("kvalues_iq4nl"), np.array(g.IQ4_NL.kvalues, np.int8))
    np.testing.assert_array_equal(grids.numpy_table("kvalues_mxfp4"), np.array(g.MXFP4.kvalues, np.int8))
    ks = np.frombuffer(g.IQ2_XXS.ksigns, dtype=np.uint8)
    expected = np.where((ks[:, None] >> np.arange(8)) & 1, -1.0, 1.0).astype(np.float32)
    np.testing.assert_array_equal(grids.numpy_table("ksigns_iq2xs"), expected)
    # the ksigns probe reads signs through iq2xs_grid[0]: it only works if no entry there is 0
    assert (grids.numpy_table("iq2xs_grid")[0] > 0).all()


def test_tables_are_read_only_and_cached_per_device():
    t = grids.numpy_table("iq1s_grid")
    with pytest.raises(ValueError):
        t[0, 0] = 5
    assert grids.table("iq1s_grid", "cpu") is grids.table("iq1s_grid", torch.device("cpu"))


# -- PackedTensor and the dispatcher -------------------------------------------------------------

def test_packed_tensor_roundtrip_and_sizes(ggml_lib):
    rng = np.random.default_rng(1)
    w = rng.standard_normal((4, 256)).astype(np.float32)
    data = ggml_lib.quantize(w, "Q4_K")
    p = PackedTensor.from_bytes(data, "q4_k", (4, 256), name="blk.0.ffn_up.weight")
    assert p.qtype == "Q4_K" and p.shape == (4, 256) and p.nbytes == len(data) == 4 * 144
    assert p.to("cpu") is p and p.device == torch.device("cpu")
    full = p.dequantize()
    _assert_bit_exact(ggml_lib.dequantize(data, "Q4_K", (4, 256)), full, "PackedTensor Q4_K")
    assert torch.equal(p.dequantize(torch.bfloat16), full.to(torch.bfloat16))
    assert "Q4_K" in repr(p) and "576 bytes" in repr(p)


def test_wrong_inputs_raise_typed_errors():
    good = torch.zeros(18, dtype=torch.uint8)
    with pytest.raises(QuantizationInputError, match="expected 36"):
        dequantize(good, "Q4_0", (2, 32))
    with pytest.raises(QuantizationInputError, match="not a multiple of Q4_K block size"):
        dequantize(torch.zeros(144, dtype=torch.uint8), "Q4_K", (1, 128))
    with pytest.raises(QuantizationInputError, match="uint8"):
        dequantize(good.to(torch.int8), "Q4_0", (1, 32))
    with pytest.raises(QuantizationInputError, match="bytes for a Q8_0"):
        PackedTensor(torch.zeros(33, dtype=torch.uint8), "Q8_0", (1, 32))
    with pytest.raises(UnknownQuantTypeError, match="no torch dequantization kernel for TQ1_0"):
        PackedTensor(torch.zeros(54, dtype=torch.uint8), "TQ1_0", (1, 256))
    with pytest.raises(UnknownQuantTypeError, match="unknown quantization type"):
        dequantize(good, "Q4_9", (1, 32))


def test_registry_refuses_a_duplicate_kernel():
    with pytest.raises(ValueError, match="already registered"):
        _registry.register("Q4_0")(lambda b: b)


def test_empty_tensor():
    out = dequantize(torch.zeros(0, dtype=torch.uint8), "Q6_K", (0, 256))
    assert out.shape == (0, 256) and out.dtype == torch.float32


def test_random_blocks_refuses_unknown_mode():
    with pytest.raises(ValueError, match="unknown block mode"):
        random_blocks("Q4_0", 1, np.random.default_rng(0), "bogus")


@pytest.mark.skipif(not torch.cuda.is_available(), reason="no CUDA/ROCm device: the GPU run of the kernels is not checked here")
@pytest.mark.parametrize("name", TYPES)
def test_kernel_on_gpu_matches_ggml(ggml_lib, name):
    rng = np.random.default_rng(99)
    shape = (16, 512)
    for mode in MODES:
        data = random_blocks(name, _n_blocks(name, shape), rng, mode).reshape(-1)
        ref = ggml_lib.dequantize(data, name, shape)
        p = PackedTensor.from_bytes(data, name, shape, device="cuda")
        out = p.dequantize()
        assert out.device.type == "cuda"
        _assert_bit_exact(ref, out.cpu(), f"{name} {mode} on GPU")
