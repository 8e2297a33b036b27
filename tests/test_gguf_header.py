"""The GGUF header reader (gguf/header.py) refuses, by file name and with what is wrong, every file
gguf.cpp refuses and every tensor whose data does not lie inside the file, before anything reads
tensor data or calls into C; its callers (recipe_inputs.gguf_inputs, tensor_table, the check run
before a stock tool) say so in one line.

Files are crafted here byte by byte from a valid tiny GGUF (the builder's output is checked against
gguf-py's reader and against libggml-base's own ``gguf_init_from_file``, which must refuse each bad
file that gguf.cpp refuses: our reader is no more lenient than the stock tools, and no stricter on
a good file).
"""

from __future__ import annotations

import re
import struct

import numpy as np
import pytest

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import CorruptFileError
from voodoo_quant.gguf import header
from voodoo_quant.gguf.recipe_inputs import gguf_inputs
from voodoo_quant.tools.llama_tools import check_gguf

U32, I32, STRING, ARRAY = 4, 5, 8, 9
F32, Q8_0 = qt.get("F32").id, qt.get("Q8_0").id


def _str(s: str) -> bytes:
    b = s.encode()
    return struct.pack("<Q", len(b)) + b


def _kv(key: str, gtype: int, value) -> bytes:
    if gtype == STRING:
        return _str(key) + struct.pack("<i", STRING) + _str(value)
    if gtype == ARRAY:  # value: (element type, raw bytes of the elements, count)
        at, raw, n = value
        return _str(key) + struct.pack("<iiQ", ARRAY, at, n) + raw
    return _str(key) + struct.pack("<i", gtype) + struct.pack({U32: "<I", I32: "<i"}[gtype], value)


def _tensors():
    """(name, ne (ggml order), type id, data) of a tiny llama-like model: an F32 and a Q8_0 tensor."""
    embd = np.arange(64 * 4, dtype="<f4").tobytes()
    q8 = bytes(qt.tensor_bytes("Q8_0", (2, 64)))
    return [["token_embd.weight", [64, 4], F32, embd], ["blk.0.attn_q.weight", [64, 2], Q8_0, q8]]


def _gguf(*, magic=b"GGUF", version=3, n_kv=None, extra_kv=(), tensors=None, offsets=None, align=32) -> bytes:
    """A GGUF laid out as gguf.cpp writes one (data padded to `align`), with any field overridden."""
    tensors = _tensors() if tensors is None else tensors
    kvs = [_kv("general.architecture", STRING, "llama"), _kv("llama.block_count", U32, 1),
           _kv("llama.attention.head_count", U32, 4), *extra_kv]
    pad = lambda n: (n + align - 1) // align * align  # noqa: E731
    out = bytearray(magic + struct.pack("<Iqq", version, len(tensors), len(kvs) if n_kv is None else n_kv))
    out += b"".join(kvs)
    off = 0
    for i, (name, ne, gtype, data) in enumerate(tensors):
        out += _str(name) + struct.pack("<I", len(ne)) + struct.pack(f"<{len(ne)}q", *ne)
        out += struct.pack("<iQ", gtype, off if offsets is None else offsets[i])
        off += pad(len(data))
    out += bytes(pad(len(out)) - len(out))
    for _, _, _, data in tensors:
        out += data + bytes(pad(len(data)) - len(data))
    return bytes(out)


def _bad_row():
    t = _tensors()
    t[1][1] = [48, 2]  # Q8_0 rows of 48: not a multiple of its block of 32
    t[1][3] = bytes(2 * 48 // 32 * 34 + 34)
    return t


def _with(i: int, **kw):
    t = _tensors()
    for k, v in kw.items():
        t[i][{"name": 0, "ne": 1, "type": 2}[k]] = v
    return t


# case -> (file bytes, what the message says, whether gguf.cpp refuses it too)
CASES = {
    "wrong-magic": (lambda: _gguf(magic=b"GGML"), "is not a GGUF file", True),
    "version-1": (lambda: _gguf(version=1), "GGUF version 1 is not supported", True),
    "version-4": (lambda: _gguf(version=4), "GGUF version 4 is not supported", True),
    "alignment-0": (lambda: _gguf(extra_kv=[_kv("general.alignment", U32, 0)]), "general.alignment 0 is not a power of 2", True),
    "alignment-24": (lambda: _gguf(extra_kv=[_kv("general.alignment", U32, 24)]), "general.alignment 24 is not a power of 2", True),
    "alignment-int32": (lambda: _gguf(extra_kv=[_kv("general.alignment", I32, 32)]), "general.alignment must be a UINT32", True),
    "duplicate-key": (lambda: _gguf(extra_kv=[_kv("llama.block_count", U32, 2)]), "duplicate key 'llama.block_count'", True),
    "nested-array": (lambda: _gguf(extra_kv=[_kv("x", ARRAY, (ARRAY, b"", 0))]), "array of arrays", True),
    "negative-count": (lambda: _gguf(n_kv=-1), "negative count", True),
    "huge-count": (lambda: _gguf(n_kv=1 << 40), "cannot fit in", True),
    "offset-unaligned": (lambda: _gguf(offsets=[0, 1028]), "tensor blk.0.attn_q.weight has data offset 1,028, expected 1,024", True),
    "offset-overlapping": (lambda: _gguf(offsets=[0, 0]), "tensor blk.0.attn_q.weight has data offset 0, expected 1,024", True),
    "type-id-unknown": (lambda: _gguf(tensors=_with(1, type=99)), "tensor blk.0.attn_q.weight has ggml type id 99", True),
    "row-not-a-block-multiple": (lambda: _gguf(tensors=_bad_row()), "48 elements per row, not a multiple of its block size 32", True),
    "five-dims": (lambda: _gguf(tensors=_with(0, ne=[64, 4, 1, 1, 1])), "tensor token_embd.weight has 5 dimensions", True),
    "negative-dim": (lambda: _gguf(tensors=_with(0, ne=[64, -4])), "tensor token_embd.weight has a negative dimension", True),
    "duplicate-tensor": (lambda: _gguf(tensors=_with(1, name="token_embd.weight", type=F32, ne=[32, 1])), "duplicate tensor name", True),
    "long-name": (lambda: _gguf(tensors=_with(1, name="blk.0." + "x" * 60)), "GGUF allows at most 63", True),
    # the loader's check (src/llama-model-loader.cpp), not gguf.cpp's: it reads no data without a context
    "data-past-end": (lambda: _gguf()[:-40], "is truncated: tensor blk.0.attn_q.weight ends at byte", False),
    # a type gguf.cpp knows (I32) but no table here sizes: refused, never read as something else
    "type-outside-the-table": (lambda: _gguf(tensors=_with(1, type=26, ne=[64, 2])), "ggml type id 26", False),
}


@pytest.fixture(scope="module")
def gguf_init(ggml_lib):
    """libggml-base's ``gguf_init_from_file`` (gguf.cpp): True when it opens the file."""
    import cffi

    ffi = cffi.FFI()
    ffi.cdef("struct gguf_init_params { bool no_alloc; void ** ctx; };"
             "void * gguf_init_from_file(const char * fname, struct gguf_init_params params);"
             "void gguf_free(void * ctx);")
    c = ffi.dlopen(str(ggml_lib.path))

    def opens(path) -> bool:
        ctx = c.gguf_init_from_file(str(path).encode(), {"no_alloc": True, "ctx": ffi.NULL})
        if ctx == ffi.NULL:
            return False
        c.gguf_free(ctx)
        return True

    return opens


def test_the_crafted_base_file_is_a_valid_gguf(tmp_path, gguf_init):
    from voodoo_quant.gguf import converter

    p = tmp_path / "ok.gguf"
    p.write_bytes(_gguf())
    kv, infos, data0 = header.read_file(p)
    assert kv["general.architecture"] == "llama" and [i[0] for i in infos] == ["token_embd.weight", "blk.0.attn_q.weight"]
    assert gguf_init(p)
    r = converter.vendored_gguf().GGUFReader(p)
    assert [(t.name, int(t.tensor_type), int(t.data_offset)) for t in r.tensors] == \
        [(n, g, data0 + off) for n, _, g, off in infos]
    table = header.tensor_table(p)
    assert table["token_embd.weight"] == ("F32", (4, 64), np.arange(256, dtype="<f4").tobytes())
    tensors, params = gguf_inputs(p)
    assert params.arch == "llama" and params.n_layer == 1 and [t.type for t in tensors] == ["F32", "Q8_0"]
    p.write_bytes(_gguf(extra_kv=[_kv("general.alignment", U32, 64)], align=64))  # another power of 2
    assert header.read_file(p)[2] % 64 == 0 and gguf_init(p)


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_bad_gguf_is_refused_by_name_before_any_data_is_read(tmp_path, case, gguf_init):
    make, says, stock_refuses = CASES[case]
    p = tmp_path / f"{case}.gguf"
    p.write_bytes(make())
    for read in (header.read_file, gguf_inputs, check_gguf, header.tensor_table):
        with pytest.raises(CorruptFileError) as e:
            read(p)
        msg = str(e.value)
        assert str(p) in msg and says in msg and "\n" not in msg, (read.__name__, msg)
    if stock_refuses:
        assert not gguf_init(p), f"{case}: gguf.cpp opens what our reader refuses"
        raw = p.read_bytes()
        with pytest.raises(CorruptFileError, match=re.escape(says.removeprefix("is ").split(",")[0])):
            header.read_header(raw, len(raw))


def test_a_header_cut_short_is_retried_then_refused(tmp_path):
    """A partial read (the header longer than the first read) is read again, larger; a file whose
    header itself is cut is refused as truncated, naming the file."""
    big = _gguf(extra_kv=[_kv("general.name", STRING, "x" * (3 << 20))])  # a 3 MiB header: read in steps
    p = tmp_path / "big.gguf"
    p.write_bytes(big)
    assert header.read_file(p)[0]["general.name"] == "x" * (3 << 20)
    with pytest.raises(header.MALFORMED):  # only the start: the caller may read more
        header.read_header(big[: 1 << 20])
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(big[: 2 << 20])
    with pytest.raises(CorruptFileError, match=f"{cut}.*runs past the end of the file"):
        header.read_file(cut)


def test_metadata_that_is_not_a_count_is_refused_by_key(tmp_path):
    p = tmp_path / "m.gguf"
    p.write_bytes(_gguf(extra_kv=[_kv("llama.expert_count", STRING, "eight")]))
    with pytest.raises(CorruptFileError, match=f"{p}: GGUF key llama.expert_count is 'eight', not a count"):
        gguf_inputs(p)
