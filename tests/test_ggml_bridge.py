"""The cffi bridge against the C library's own tables and an independent reference (gguf-py).

Every type of the table: sizes equal ggml's traits, bytes round-trip, and ggml ``to_float``
equals the vendored ``gguf.quants.dequantize`` exactly; for the types gguf-py can quantize, the
bytes equal its ``quantize`` too. Tensors are small: the IQ grids cost seconds once per process.
"""

from __future__ import annotations

import signal
import subprocess
import sys
import textwrap

import numpy as np
import pytest

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import QuantizationInputError
from voodoo_quant.core.ggml import _row_spans

ALL = list(qt.QTYPES)
# gguf-py implements quantize_blocks for exactly these (gguf-py/gguf/quants.py; docs/facts.md).
GGUF_PY_QUANTIZES = ["Q8_0", "Q4_0", "Q4_1", "Q5_0", "Q5_1", "BF16", "MXFP4", "TQ1_0", "TQ2_0"]


def _weights(rows: int, cols: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal((rows, cols)).astype(np.float32)


def _imatrix(cols: int, seed: int = 1) -> np.ndarray:
    return np.random.default_rng(seed).uniform(0.1, 2.0, cols).astype(np.float32)


def assert_same_bytes(got: bytes, want: bytes, q: qt.QType) -> None:
    """Equal, or fail saying how many blocks differ and which one first."""
    assert len(got) == len(want), f"{q.name}: {len(got)} bytes vs {len(want)}"
    if got == want:
        return
    a = np.frombuffer(got, np.uint8).reshape(-1, q.type_size)
    b = np.frombuffer(want, np.uint8).reshape(-1, q.type_size)
    bad = np.nonzero((a != b).any(axis=1))[0]
    worst = int(bad[np.argmax((a[bad] != b[bad]).sum(axis=1))])
    pytest.fail(f"{q.name}: {bad.size}/{a.shape[0]} blocks differ; most different block {worst}: "
                f"{a[worst].tobytes().hex()} vs {b[worst].tobytes().hex()}")


@pytest.mark.parametrize("name", ALL)
def test_table_matches_ggml_traits(ggml_lib, vendored_gguf_quants, name):
    q = qt.QTYPES[name]
    t = ggml_lib.traits(q)
    assert (t.block, t.type_size) == (q.block, q.type_size)
    assert t.name.upper() == q.name
    assert t.is_quantized == (not q.is_float)
    assert ggml_lib.requires_imatrix(q) == q.ggml_needs_imatrix
    assert ggml_lib.row_size(q, 256 * 3) == q.row_bytes(256 * 3)
    consts = sys.modules[vendored_gguf_quants.__package__ + ".constants"]
    gt = consts.GGMLQuantizationType[name]
    assert int(gt) == q.id and consts.GGML_QUANT_SIZES[gt] == (q.block, q.type_size)


@pytest.mark.parametrize("name", ALL)
def test_round_trip_equals_gguf_py_dequantize(ggml_lib, vendored_gguf_quants, name):
    q = qt.QTYPES[name]
    w = _weights(8, 512)
    data = ggml_lib.quantize(w, q, _imatrix(512), name=f"rt.{name}")
    assert len(data) == qt.tensor_bytes(q, w.shape)
    assert ggml_lib.validate_bytes(data, q)
    deq = ggml_lib.dequantize(data, q, w.shape)
    assert deq.shape == w.shape and deq.dtype == np.float32
    consts = sys.modules[vendored_gguf_quants.__package__ + ".constants"]
    ref = vendored_gguf_quants.dequantize(np.frombuffer(data, np.uint8).reshape(8, -1), consts.GGMLQuantizationType[name])
    assert np.array_equal(deq, ref.astype(np.float32)), f"{name}: {int((deq != ref).sum())} values differ"
    # The bytes encode the weights (ternary TQ types are the coarsest: corr ~0.72 on Gaussians).
    assert np.corrcoef(w.ravel(), deq.ravel())[0, 1] > 0.7


@pytest.mark.parametrize("name", GGUF_PY_QUANTIZES)
def test_bytes_equal_gguf_py_quantize(ggml_lib, vendored_gguf_quants, name):
    q = qt.QTYPES[name]
    w = _weights(16, 512, seed=3) * np.float32(0.05)
    consts = sys.modules[vendored_gguf_quants.__package__ + ".constants"]
    ref = vendored_gguf_quants.quantize(w, consts.GGMLQuantizationType[name])
    assert_same_bytes(ggml_lib.quantize(w, q, name=f"ref.{name}"), ref.tobytes(), q)


@pytest.mark.parametrize("name,imat", [("Q4_K", True), ("Q6_K", False), ("IQ4_XS", True),
                                       ("IQ2_XXS", True), ("Q8_0", False), ("Q3_K", True)])
def test_multithreaded_equals_single_threaded(ggml_lib, name, imat):
    w = _weights(100, 512, seed=5)  # 100 rows: uneven spans
    assert len(_row_spans(100, 4)) > 1  # the threaded path really splits
    im = _imatrix(512) if imat else None
    one = ggml_lib.quantize(w, name, im, workers=1)
    four = ggml_lib.quantize(w, name, im, workers=4)
    assert_same_bytes(four, one, qt.get(name))


def _bad_calls():
    w = _weights(4, 256)
    im = _imatrix(256)
    nan = w.copy()
    nan[1, 7] = np.nan
    return {
        "row length IQ": (lambda g: g.quantize(_weights(4, 100), "IQ2_XXS", _imatrix(100)), "not a multiple of IQ2_XXS block size"),
        "row length K": (lambda g: g.quantize(_weights(4, 288), "Q4_K"), "row size (288) is not a multiple of Q4_K block size (256)"),
        "missing imatrix": (lambda g: g.quantize(w, "IQ2_XXS"), "requires an importance matrix"),
        "NaN": (lambda g: g.quantize(nan, "Q4_0"), "non-finite"),
        "dtype": (lambda g: g.quantize(w.astype(np.float64), "Q8_0"), "float32"),
        "non-contiguous": (lambda g: g.quantize(_weights(4, 512)[:, ::2], "Q8_0"), "C-contiguous"),
        "fortran order": (lambda g: g.quantize(np.asfortranarray(w), "Q8_0"), "C-contiguous"),
        "1-D": (lambda g: g.quantize(w.ravel(), "Q8_0"), "2-D"),
        "imatrix length": (lambda g: g.quantize(w, "Q4_K", im[:255]), "imatrix has 255 values"),
        "imatrix zeros": (lambda g: g.quantize(w, "IQ2_XXS", np.zeros(256, np.float32)), "all zeros"),
        "imatrix negative": (lambda g: g.quantize(w, "Q4_K", -im), "negative"),
        "imatrix dtype": (lambda g: g.quantize(w, "Q4_K", im.astype(np.float64)), "float32"),
        "dequantize length": (lambda g: g.dequantize(b"\0" * 10, "Q4_0", (1, 32)), "expected 18"),
    }


@pytest.mark.parametrize("case", list(_bad_calls()))
def test_validation_errors(ggml_lib, case):
    call, msg = _bad_calls()[case]
    with pytest.raises(QuantizationInputError, match=msg.replace("(", r"\(").replace(")", r"\)")):
        call(ggml_lib)
    # The process still works afterwards.
    assert len(ggml_lib.quantize(_weights(1, 32), "Q8_0")) == 34


_CHILD = textwrap.dedent("""
    import sys
    import numpy as np
    from voodoo_quant.core import ggml
    g = ggml.lib()
    case = sys.argv[1]
    w = np.ones((2, 256), np.float32)
    if case == "iq_bad_row":
        g.quantize(np.ones((2, 100), np.float32), "IQ1_S", np.ones(100, np.float32))
    elif case == "iq_no_imatrix":
        g.quantize(w, "IQ2_XXS")
    elif case == "raw_no_imatrix":
        # Positive control: the same call straight into C, without our checks.
        out = bytearray(2 * 66)
        g._c.ggml_quantize_chunk(16, g._ffi.from_buffer("float[]", w), g._ffi.from_buffer(out), 0, 2, 256, g._ffi.NULL)
    print("returned")
""")


def _child(case: str) -> subprocess.CompletedProcess:
    import os

    env = dict(os.environ, GGML_NO_BACKTRACE="1")
    return subprocess.run([sys.executable, "-c", _CHILD, case], capture_output=True, text=True, env=env, timeout=120)


@pytest.mark.parametrize("case", ["iq_bad_row", "iq_no_imatrix"])
def test_abort_cases_raise_in_a_child_instead_of_aborting(case):
    r = _child(case)
    assert r.returncode == 1, (r.returncode, r.stderr[-2000:])
    assert "QuantizationInputError" in r.stderr and "returned" not in r.stdout


def test_unchecked_c_call_really_aborts():
    # Proves the test above can fail: without the bridge's checks ggml aborts the process.
    r = _child("raw_no_imatrix")
    assert r.returncode == -signal.SIGABRT, (r.returncode, r.stderr[-2000:])
