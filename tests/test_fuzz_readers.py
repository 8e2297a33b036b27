"""Fuzzing every binary reader with truncated and bit-flipped files (hypothesis, bounded).

A reader may accept a mutated file only if it still parses to a valid object; otherwise it must
raise the package's typed error naming the file — never another exception (a traceback in the
CLI) and never a process abort. Each reader gets ~50 examples of one of: truncation at any
length, 1–8 random bit flips, or both.
"""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from voodoo_quant.candidates.cache import CandidateCache
from voodoo_quant.core import fileio
from voodoo_quant.core.errors import ConfigError, CorruptFileError, VoodooError
from voodoo_quant.gguf import header, imatrix
from voodoo_quant.selection.assignment import Assignment, TensorChoice
from voodoo_quant.training import journal

FUZZ = settings(max_examples=50, deadline=None, derandomize=True,
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
COUNTS: dict[str, dict[str, int]] = {}  # reader -> outcome counts (printed by the last test)


@st.composite
def mutation(draw, data: bytes) -> bytes:
    kind = draw(st.sampled_from(["truncate", "flip", "both"]))
    out = bytearray(data)
    if kind in ("flip", "both"):
        for _ in range(draw(st.integers(1, 8))):
            pos = draw(st.integers(0, len(out) - 1))
            out[pos] ^= 1 << draw(st.integers(0, 7))
    if kind in ("truncate", "both"):
        out = out[: draw(st.integers(0, len(out) - 1))]
    return bytes(out)


def _record(reader: str, outcome: str) -> None:
    c = COUNTS.setdefault(reader, {})
    c[outcome] = c.get(outcome, 0) + 1


def _expect_clean(reader: str, path, fn, allowed=(CorruptFileError,)):
    """Run `fn()`: a value, or an allowed typed error whose one-line message names `path`."""
    try:
        value = fn()
    except allowed as e:
        msg = str(e)
        assert str(path) in msg, msg
        assert "\n" not in msg.strip() and "Traceback" not in msg
        _record(reader, "rejected")
        return None
    _record(reader, "accepted")
    return value


# -- imatrix, GGUF and legacy --------------------------------------------------------------------
def _imatrix() -> imatrix.Imatrix:
    rng = np.random.default_rng(0)
    ents = {f"blk.{i}.ffn_down.weight": imatrix.Entry(rng.random(64, dtype=np.float32) * 10, np.array([96]))
            for i in range(2)}
    return imatrix.Imatrix(ents, datasets=["calib.txt"], chunk_count=3, chunk_size=32)


IMX_GGUF = _imatrix().to_gguf_bytes()


@FUZZ
@given(data=mutation(IMX_GGUF))
def test_fuzz_imatrix_gguf(tmp_path, data):
    p = tmp_path / "imatrix.gguf"
    p.write_bytes(data)
    im = _expect_clean("imatrix (GGUF)", p, lambda: imatrix.load(p))
    if im is not None:
        for name in im.names():
            try:
                im.get_vector(name, 64)
            except imatrix.ImatrixMismatchError as e:
                assert str(p) in str(e)


@FUZZ
@given(data=st.data())
def test_fuzz_imatrix_legacy(tmp_path_factory, data):
    d = tmp_path_factory.mktemp("dat")
    src = _imatrix()
    src.save_dat(d / "good.dat")
    raw = data.draw(mutation((d / "good.dat").read_bytes()))
    p = d / "imatrix.dat"
    p.write_bytes(raw)
    _expect_clean("imatrix (legacy .dat)", p, lambda: imatrix.load(p))


# -- .pt files: tokens, journal, checkpoints -----------------------------------------------------
@pytest.fixture(scope="module")
def pt_blobs(tmp_path_factory):
    d = tmp_path_factory.mktemp("pt")
    g = torch.Generator().manual_seed(0)
    fileio.torch_save(d / "tokens.pt", torch.randint(0, 512, (4, 16), generator=g))
    gates = {"a.weight": torch.randn(3, generator=g), "b.weight": torch.randn(4, generator=g)}
    opt = torch.optim.Adam([torch.nn.Parameter(v.clone()) for v in gates.values()], lr=0.1)
    journal.save(d / "partial.pt", journal.JournalState(3, gates, opt.state_dict(), torch.get_rng_state(), "h", {"k": 1}))
    return {"tokens": (d / "tokens.pt").read_bytes(), "journal": (d / "partial.pt").read_bytes()}


@FUZZ
@given(data=st.data())
def test_fuzz_tokens_pt(tmp_path_factory, pt_blobs, data):
    from voodoo_quant.training.setup import load_tokens

    p = tmp_path_factory.mktemp("tok") / "train_tokens.pt"
    p.write_bytes(data.draw(mutation(pt_blobs["tokens"])))
    t = _expect_clean("tokens .pt", p, lambda: load_tokens(p, 8), allowed=(CorruptFileError, ConfigError))
    if t is not None:
        assert t.dtype == torch.int64 and t.shape[1] == 8


@FUZZ
@given(data=st.data())
def test_fuzz_journal(tmp_path_factory, pt_blobs, data):
    p = tmp_path_factory.mktemp("jr") / "partial.pt"
    p.write_bytes(data.draw(mutation(pt_blobs["journal"])))
    s = _expect_clean("journal partial.pt", p,
                      lambda: journal.load(p, expect_hash="h", expect_names={"a.weight", "b.weight"}),
                      allowed=(CorruptFileError, journal.JournalMismatchError))
    if s is not None:
        assert s.step >= 0 and set(s.gates) == {"a.weight", "b.weight"}


# -- candidate cache entries ---------------------------------------------------------------------
@FUZZ
@given(data=st.data(), target=st.sampled_from(["data.bin", "meta.json"]))
def test_fuzz_cache_entry_is_rebuilt_never_served_corrupt(tmp_path_factory, ggml_lib, data, target):
    cache = CandidateCache(tmp_path_factory.mktemp("cache"))
    m = np.random.default_rng(1).standard_normal((4, 64), dtype=np.float32)
    key = cache.key(m, "Q8_0", version="fuzz")
    good = ggml_lib.quantize(m, "Q8_0")
    cache.put(key, good)
    meta = cache.entry_dir(key) / "meta.json"
    fileio.write_json(meta, {**json.loads(meta.read_text()), "created": 0.0})  # same length every example
    f = cache.entry_dir(key) / target
    f.write_bytes(data.draw(mutation(f.read_bytes())))
    got = cache.get(key)
    _record(f"cache {target}", "rebuilt" if got is None else "intact")
    assert got is None or got == good  # a corrupt entry is a miss, never wrong bytes
    if got is None:
        assert cache.stats.corrupt == 1 and not cache.entry_dir(key).exists()
        again = cache.get_or_build(m, "Q8_0", key=key)
        assert again == good


# -- JSON: assignment.json, meta.json ------------------------------------------------------------
ASG = Assignment(
    tensors={"w": TensorChoice(name="w", qtype="Q8_0", shape=(4, 64), nbytes=272, gguf_name="blk.0.attn_q.weight",
                               confidence=0.9, menu=("Q4_0", "Q8_0"))},
    model="m", imatrix=None, imatrix_sha256=None, target_bytes=272, meta={},
)


@FUZZ
@given(data=mutation(json.dumps(ASG.to_dict()).encode()))
def test_fuzz_assignment_json(tmp_path, data):
    p = tmp_path / "assignment.json"
    p.write_bytes(data)
    _expect_clean("assignment.json", p, lambda: Assignment.load(p), allowed=(CorruptFileError, ConfigError))


# -- GGUF model files (gguf/header.py, the reader used before handing a GGUF to llama.cpp) --------
@pytest.fixture(scope="module")
def small_gguf(tmp_path_factory):
    from voodoo_quant.gguf import converter

    gguf = converter.vendored_gguf()
    p = tmp_path_factory.mktemp("g") / "m.gguf"
    w = gguf.GGUFWriter(p, "llama")
    w.add_block_count(1)
    w.add_string("general.name", "fuzz")
    w.add_tensor("token_embd.weight", np.arange(64 * 4, dtype=np.float32).reshape(4, 64))
    w.add_tensor("blk.0.attn_q.weight", np.ones((2, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return p.read_bytes()


@FUZZ
@given(data=st.data())
def test_fuzz_gguf_header_reader(tmp_path_factory, small_gguf, data):
    from voodoo_quant.tools.llama_tools import gguf_tensor_stats

    p = tmp_path_factory.mktemp("gg") / "model.gguf"
    p.write_bytes(data.draw(mutation(small_gguf)))
    _expect_clean("GGUF model", p, lambda: gguf_tensor_stats(p))


@FUZZ
@given(data=st.data())
def test_fuzz_read_header_raises_only_what_it_documents(small_gguf, data):
    """The reader itself, on a mutated model file: a header, or one of ``header.MALFORMED`` or a
    CorruptFileError (what every caller catches), never another exception."""
    raw = data.draw(mutation(small_gguf))
    try:
        kv, infos, data0 = header.read_header(raw)
    except (*header.MALFORMED, CorruptFileError):
        _record("GGUF header (read_header)", "rejected")
        return
    _record("GGUF header (read_header)", "accepted")
    assert isinstance(kv, dict) and isinstance(data0, int) and all(len(i) == 4 for i in infos)


def _gguf_imatrix_with(kv_bytes: bytes, n_kv: int) -> bytes:
    import struct

    return b"GGUF" + struct.pack("<Iqq", 3, 0, n_kv) + kv_bytes


@pytest.mark.parametrize("case", ["kv-type-confusion", "alignment-zero", "deep-nesting", "negative-dims"])
def test_crafted_imatrix_headers_are_rejected_cleanly(tmp_path, case):
    """Hostile headers random flips rarely reach: each must be a CorruptFileError, not a crash."""
    import struct

    from voodoo_quant.gguf.imatrix import _kv_u32, _str

    if case == "kv-type-confusion":  # datasets as an integer, chunk_count as a string
        raw = _gguf_imatrix_with(_kv_u32("imatrix.datasets", 3) + _str("imatrix.chunk_count") + struct.pack("<i", 8)
                                 + _str("x") + _kv_u32("imatrix.chunk_size", 1), 3)
        raw = raw[:16] + struct.pack("<q", 1) + raw[24:]  # one tensor info follows
        raw += _str("a.in_sum2") + struct.pack("<Iq", 1, 1) + struct.pack("<iQ", 0, 0)
        raw += _str("a.counts") + struct.pack("<Iq", 1, 1) + struct.pack("<iQ", 0, 32)
        raw = raw[:4] + struct.pack("<Iqq", 3, 2, 3) + raw[24:]
        raw += b"\0" * 64
    elif case == "alignment-zero":
        raw = _gguf_imatrix_with(_kv_u32("general.alignment", 0), 1)
    elif case == "deep-nesting":  # arrays of arrays, 100k deep
        raw = _gguf_imatrix_with(_str("k") + struct.pack("<i", 9) + struct.pack("<iQ", 9, 1) * 100_000, 1)
    else:
        raw = b"GGUF" + struct.pack("<Iqq", 3, 1, 0) + _str("a.in_sum2") + struct.pack("<Iqq", 2, -4, 4)
        raw += struct.pack("<iQ", 0, 0) + b"\0" * 64
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(raw)
    with pytest.raises(CorruptFileError, match=str(p)):
        imatrix.load(p)


def test_zz_fuzz_summary():
    """Prints the outcome table; fails if a reader above never ran."""
    for reader, c in sorted(COUNTS.items()):
        print(f"{reader:28s} {c}")
    assert len(COUNTS) >= 8, COUNTS
    assert all(sum(c.values()) >= 20 for c in COUNTS.values()), COUNTS
    assert all(isinstance(e, type) and issubclass(e, VoodooError) for e in (CorruptFileError, ConfigError))
