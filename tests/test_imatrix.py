"""imatrix: GGUF and legacy .dat I/O, llama.cpp's exact division, computing one in torch, and
interop with stock llama-imatrix / llama-quantize (slow tests)."""

from __future__ import annotations

import re
import struct
import subprocess

import numpy as np
import pytest

from voodoo_quant.core import paths
from voodoo_quant.core.errors import CorruptFileError
from voodoo_quant.gguf import header, imatrix
from voodoo_quant.gguf.imatrix import Entry, Imatrix, ImatrixMismatchError
from voodoo_quant.gguf.imatrix_compute import compute_imatrix

# HF → GGUF names of a Llama (gguf-py tensor_mapping.py), for the tests only.
_LLAMA = {
    "self_attn.q_proj": "attn_q", "self_attn.k_proj": "attn_k", "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output", "mlp.gate_proj": "ffn_gate", "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}


def llama_name(hf: str) -> str | None:
    m = re.fullmatch(r"model\.layers\.(\d+)\.(\w+\.\w+)\.weight", hf)
    if m and m.group(2) in _LLAMA:
        return f"blk.{m.group(1)}.{_LLAMA[m.group(2)]}.weight"
    return None


def _synthetic(seed=0, n=3) -> Imatrix:
    rng = np.random.default_rng(seed)
    entries = {f"blk.{i}.ffn_down.weight": Entry(rng.uniform(1, 900, 512), [1155]) for i in range(n)}
    entries["blk.0.attn_q.weight"] = Entry(rng.uniform(1, 900, 256), [1155])
    return Imatrix(entries, datasets=["calib.txt"], chunk_count=18, chunk_size=64)


# -- file formats ------------------------------------------------------------------------------

def test_gguf_round_trip_and_layout(tmp_path):
    im = _synthetic()
    p = im.save_gguf(tmp_path / "a.imatrix.gguf")
    back = imatrix.load(p)
    assert back.names() == im.names() and not back.is_legacy
    assert (back.datasets, back.chunk_count, back.chunk_size) == (["calib.txt"], 18, 64)
    for n in im.names():
        assert np.array_equal(back.entries[n].sums, im.entries[n].sums)
        assert back.entries[n].counts.tolist() == [1155]
    assert back.content_hash() == im.content_hash()
    assert back.save_gguf(tmp_path / "b.gguf").read_bytes() == p.read_bytes()
    # The PyPI gguf reader agrees on names, shapes and values (an independent parser).
    from gguf import GGUFReader

    r = GGUFReader(p)
    assert r.fields["general.type"].contents() == "imatrix"
    t = {x.name: x for x in r.tensors}
    assert sorted(t) == sorted(n + s for n in im.names() for s in (".in_sum2", ".counts"))
    assert np.array_equal(t["blk.1.ffn_down.weight.in_sum2"].data, im.entries["blk.1.ffn_down.weight"].sums)


def test_legacy_dat_round_trip(tmp_path):
    rng = np.random.default_rng(1)
    # A hand-written legacy file, laid out as imatrix.cpp save_imatrix_legacy writes it.
    raw = struct.pack("<i", 2)
    vals = {}
    for name, n in (("blk.0.attn_k.weight", 256), ("blk.0.ffn_down.weight", 512)):
        v = rng.uniform(0.5, 50, n).astype(np.float32)
        vals[name] = v
        raw += struct.pack("<i", len(name)) + name.encode() + struct.pack("<ii", 7, n) + v.tobytes()
    raw += struct.pack("<ii", 7, 9) + b"calib.txt"
    src = tmp_path / "old.dat"
    src.write_bytes(raw)
    im = imatrix.load(src)
    assert im.is_legacy and im.chunk_count == 7 and im.datasets == ["calib.txt"]
    # quantize.cpp load_imatrix: legacy vector = sums / ncall in float32.
    assert np.array_equal(im.vector("blk.0.ffn_down.weight", 512), vals["blk.0.ffn_down.weight"] / np.float32(7))
    assert im.save_dat(tmp_path / "again.dat").read_bytes() == raw
    # Legacy → GGUF keeps every quantizer vector bit for bit.
    g = imatrix.load(im.save_gguf(tmp_path / "conv.gguf"))
    for n in im.names():
        assert np.array_equal(g.vector(n, im.entries[n].sums.size), im.vector(n, im.entries[n].sums.size))
    # GGUF → legacy follows save_imatrix_legacy: (sum / count) * ncall, ncall = ceil(count / chunk).
    s = _synthetic()
    d = imatrix.load(s.save_dat(tmp_path / "s.dat"))
    ncall = -(-1155 // 64)
    e = s.entries["blk.0.attn_q.weight"]
    assert d.entries["blk.0.attn_q.weight"].counts.tolist() == [ncall]
    assert np.array_equal(d.entries["blk.0.attn_q.weight"].sums, (e.sums / np.float32(1155)) * np.float32(ncall))


def test_corrupt_files_are_clear_errors(tmp_path):
    good = _synthetic().save_gguf(tmp_path / "g.gguf").read_bytes()
    (tmp_path / "t.gguf").write_bytes(good[: len(good) - 100])
    with pytest.raises(CorruptFileError, match="t.gguf"):
        imatrix.load(tmp_path / "t.gguf")
    (tmp_path / "junk.dat").write_bytes(b"\x05\0\0\0abc")
    with pytest.raises(CorruptFileError, match="junk.dat"):
        imatrix.load(tmp_path / "junk.dat")
    with pytest.raises(CorruptFileError, match="does not exist"):
        imatrix.load(tmp_path / "nope.gguf")


def test_missing_entries_and_wrong_lengths_are_errors():
    im = _synthetic()
    with pytest.raises(ImatrixMismatchError, match="512 values, tensor expects 256"):
        im.vector("blk.0.ffn_down.weight", 256)
    with pytest.raises(ImatrixMismatchError, match="512 values, tensor expects 256"):
        im.get_vector("blk.1.ffn_down.weight", 256)
    with pytest.raises(ImatrixMismatchError, match="no entry for tensor blk.7.ffn_down.weight"):
        im.vector("blk.7.ffn_down.weight", 512)
    assert im.get_vector("blk.7.ffn_down.weight", 512) is None  # stock: quantize without one
    got = im.get_vector("blk.1.ffn_down.weight", 512)
    assert got.dtype == np.float32 and got.size == 512


def test_entries_for_tensors_the_model_lacks_are_ignored_as_llama_quantize_ignores_them(tiny_llama_hf_dir):
    """The check that an imatrix fits the model (``setup.imatrix_vectors``, in train and precache):
    it must cover one of the planned tensors, and every entry it gives must have the tensor's
    length; an entry naming a tensor the model lacks is ignored, as stock llama-quantize ignores it
    (src/llama-quant.cpp looks each tensor up), so the candidates keep stock's bytes."""
    from voodoo_quant.gguf.layout import model_layouts
    from voodoo_quant.training.setup import imatrix_vectors

    lays = sorted((lay for lay in model_layouts(tiny_llama_hf_dir).values()
                   if lay.quantizable and lay.gguf_name.startswith("blk.")), key=lambda lay: lay.gguf_name)
    covered = lays[::2]
    rng = np.random.default_rng(0)
    other = {"blk.7.ffn_down.weight": Entry(rng.uniform(1, 9, 128), [8])}  # a layer the 2-layer model lacks
    im = Imatrix({lay.gguf_name: Entry(rng.uniform(1, 9, lay.n_per_row), [8]) for lay in covered} | other, ["x"], 1, 8)
    got = imatrix_vectors(im, lays)
    assert sorted(got) == [lay.gguf_name for lay in covered]  # the others: quantized without one
    assert all(np.array_equal(got[lay.gguf_name], im.vector(lay.gguf_name, lay.n_per_row)) for lay in covered)
    with pytest.raises(ImatrixMismatchError, match=f"covers none of the model's {len(lays)} selectable tensors"):
        imatrix_vectors(Imatrix(other, ["x"], 1, 8), lays)
    short = covered[0]
    wrong = Imatrix({short.gguf_name: Entry(np.ones(short.n_per_row + 32), [8])}, ["x"], 1, 8)
    with pytest.raises(ImatrixMismatchError, match=f"{short.gguf_name} has {short.n_per_row + 32} values"):
        imatrix_vectors(wrong, lays)


def test_exact_division_rule_changes_kquant_bytes(ggml_lib):
    """float32(in_sum2) / float32(count) — as quantize.cpp — not the float64 mean: one ulp in
    the vector changes Q4_K bytes, so the float64 path would not match llama-quantize."""
    rng = np.random.default_rng(1)
    w = rng.standard_normal((64, 256)).astype(np.float32)
    s64 = rng.uniform(0, 1, 256) * 1000  # exact sums of squares, as accumulated in float64
    count = 3 * 7 * 11
    im = Imatrix({"t": Entry(s64.astype(np.float32), [count])}, chunk_size=64)
    ours = im.vector("t", 256)
    llama = s64.astype(np.float32) / np.float32(count)  # the file holds float32 sums
    f64 = (s64 / count).astype(np.float32)
    assert np.array_equal(ours, llama)
    assert (ours != f64).sum() > 0
    assert ggml_lib.quantize(w, "Q4_K", ours) != ggml_lib.quantize(w, "Q4_K", f64)


def test_hashes_follow_vectors_not_files(tmp_path):
    a = _synthetic(0)
    b = imatrix.load(a.save_gguf(tmp_path / "x.gguf"))
    assert a.content_hash() == b.content_hash()
    assert a.vector_hash("blk.0.attn_q.weight") == b.vector_hash("blk.0.attn_q.weight")
    assert a.vector_hash("blk.0.ffn_down.weight") != a.vector_hash("blk.1.ffn_down.weight")
    b.entries["blk.1.ffn_down.weight"].counts[:] = 1156
    assert a.content_hash() != b.content_hash()


# -- computing one in torch --------------------------------------------------------------------

@pytest.fixture(scope="module")
def tiny_llama():
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=300, hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_compute_imatrix_equals_numpy(tiny_llama):
    import torch

    model = tiny_llama
    batches = [torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(i)) for i in range(3)]
    batches.append(torch.randint(0, 300, (1, 8)))  # 8 rows < 16: llama-imatrix skips such calls
    captured: dict[str, list[np.ndarray]] = {}
    hooks = []
    for name, mod in model.named_modules():
        if llama_name(name + ".weight"):
            hooks.append(mod.register_forward_pre_hook(
                lambda m, inp, name=name: captured.setdefault(name, []).append(inp[0].reshape(-1, inp[0].shape[-1]).numpy().copy())))
    with torch.no_grad():
        for b in batches:
            model(input_ids=b)
    for h in hooks:
        h.remove()

    im = compute_imatrix(model, batches, llama_name, chunk_size=16, datasets=["rand"])
    assert len(im.entries) == 14
    assert im.chunk_size == 16 and im.datasets == ["rand"]
    for name, xs in captured.items():
        g = llama_name(name + ".weight")
        xs = [x for x in xs if x.shape[0] >= 16]
        assert len(xs) == 3
        x = np.concatenate(xs).astype(np.float64)
        ref_sums = (x * x).sum(0).astype(np.float32)
        e = im.entries[g]
        assert e.counts.tolist() == [x.shape[0]] == [144]
        np.testing.assert_array_max_ulp(e.sums, ref_sums, maxulp=1)
        assert np.array_equal(im.vector(g, x.shape[1]), e.sums / np.float32(144))


def test_compute_imatrix_stops_before_an_unrecorded_head(tiny_llama):
    import torch

    batches = [torch.randint(0, 300, (2, 24), generator=torch.Generator().manual_seed(7))]
    head_runs = []
    counter = tiny_llama.lm_head.register_forward_hook(lambda *a: head_runs.append(1))
    try:
        skipped = compute_imatrix(tiny_llama, batches, llama_name)
        assert head_runs == []  # the vocabulary-wide matmul never ran
        with_head = compute_imatrix(  # a map that records the head: it runs, and its entry is there
            tiny_llama, batches, lambda hf: "output.weight" if hf == "lm_head.weight" else llama_name(hf))
        assert head_runs == [1] and "output.weight" in with_head.entries
    finally:
        counter.remove()
    assert not tiny_llama.lm_head._forward_pre_hooks  # nothing left behind
    assert set(skipped.entries) == set(with_head.entries) - {"output.weight"}
    for g, e in skipped.entries.items():  # the same sums: the layers before the head ran the same
        assert np.array_equal(e.sums, with_head.entries[g].sums) and e.counts.tolist() == with_head.entries[g].counts.tolist()


def test_compute_imatrix_column_perm_and_refusals(tiny_llama):
    import torch

    batches = [torch.randint(0, 300, (1, 32), generator=torch.Generator().manual_seed(5))]
    plain = compute_imatrix(tiny_llama, batches, llama_name)
    perm = np.arange(96)[::-1].copy()
    permuted = compute_imatrix(
        tiny_llama, batches, llama_name,
        column_perm=lambda hf: perm if hf.endswith("down_proj.weight") else None)
    g = "blk.1.ffn_down.weight"
    assert np.array_equal(permuted.entries[g].sums, plain.entries[g].sums[perm])
    assert np.array_equal(permuted.entries["blk.1.attn_q.weight"].sums, plain.entries["blk.1.attn_q.weight"].sums)
    with pytest.raises(ImatrixMismatchError, match="no nn.Linear"):
        compute_imatrix(tiny_llama, batches, lambda hf: None)
    with pytest.raises(ImatrixMismatchError, match=">= 16 rows"):
        compute_imatrix(tiny_llama, [torch.randint(0, 300, (1, 8))], llama_name)
    with pytest.raises(ImatrixMismatchError, match="not a permutation"):
        compute_imatrix(tiny_llama, batches, llama_name, column_perm=lambda hf: np.zeros(96, int))


# -- stock llama.cpp interop (slow) ------------------------------------------------------------

def _run(cmd):
    proc = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    assert proc.returncode == 0, f"{cmd[0]} failed ({proc.returncode}):\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def stock_imatrix(tmp_path_factory, imatrix_llama256_gguf, imatrix_text_file):
    out = tmp_path_factory.mktemp("stock_imatrix") / "imatrix.gguf"
    _run([paths.tool_path("llama-imatrix"), "-m", imatrix_llama256_gguf, "-f", imatrix_text_file,
          "-o", out, "-c", "64", "-b", "64", "--chunks", "4", "--no-ppl", "-t", "2"])
    return out


@pytest.mark.slow
def test_load_stock_llama_imatrix_and_rewrite_identically(stock_imatrix, imatrix_text_file, tmp_path):
    im = imatrix.load(stock_imatrix)
    expected = {f"blk.{i}.{t}.weight" for i in range(2) for t in _LLAMA.values()}
    assert set(im.names()) == expected  # no token_embd, no output (without --process-output)
    assert (im.chunk_size, im.chunk_count) == (64, 4)
    assert im.datasets == [str(imatrix_text_file)]
    for n in im.names():
        assert im.entries[n].counts.tolist() == [4 * 64]
        assert im.vector(n, 512 if "ffn_down" in n else 256).size in (256, 512)
    # Our writer reproduces the stock file byte for byte from the loaded data.
    assert im.save_gguf(tmp_path / "ours.gguf").read_bytes() == stock_imatrix.read_bytes()
    assert im.sha256 is not None and len(im.sha256) == 64


@pytest.mark.slow
@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_our_imatrix_file_drives_stock_llama_quantize_identically(fmt, tmp_path, imatrix_llama256_gguf, ggml_lib):
    im = _synthetic(seed=4, n=2)
    im.entries.update({"blk.1.attn_q.weight": Entry(np.random.default_rng(9).uniform(1, 50, 256), [1155])})
    path = im.save_gguf(tmp_path / "ours.gguf") if fmt == "gguf" else im.save_dat(tmp_path / "ours.dat")
    loaded = imatrix.load(path)
    out = tmp_path / "q4k.gguf"
    # token_embd stays F32 (it has no imatrix entry; quantizing 12.6 M weights only costs time).
    _run([paths.tool_path("llama-quantize"), "--pure", "--token-embedding-type", "f32", "--imatrix", path,
          imatrix_llama256_gguf, out, "Q4_K", "2"])
    src, dst = header.tensor_table(imatrix_llama256_gguf), header.tensor_table(out)
    checked = 0
    for name in loaded.names():
        t, shape, data = src[name]
        assert t == "F32" and dst[name][0] == "Q4_K"
        w = np.frombuffer(data, dtype=np.float32).reshape(shape).copy()
        vec = loaded.vector(name, w.shape[1])
        ours = ggml_lib.quantize(w, "Q4_K", vec, name=name)
        assert dst[name][2] == ours, name
        # ... and not what the tensor would get without the imatrix (the vector mattered).
        assert ggml_lib.quantize(w, "Q4_K", None) != ours
        checked += 1
    assert checked == 4


@pytest.mark.slow
def test_compute_imatrix_matches_stock_llama_imatrix(stock_imatrix, imatrix_llama256_hf_dir, imatrix_text_file):
    """Same model, same tokens (64-token chunks, no BOS: the GGUF says add_bos_token=False):
    our torch statistics are llama-imatrix's, per GGUF column, up to float rounding of two
    different matmul kernels. Counts are exact; a wrong column order or tensor would be far off."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(imatrix_llama256_hf_dir)
    ids = tok(imatrix_text_file.read_text(encoding="utf-8"))["input_ids"]
    model = AutoModelForCausalLM.from_pretrained(imatrix_llama256_hf_dir, dtype=torch.float32)
    batches = [torch.tensor([ids[i * 64:(i + 1) * 64]]) for i in range(4)]
    ours = compute_imatrix(model, batches, llama_name, chunk_size=64)
    stock = imatrix.load(stock_imatrix)
    assert ours.names() == stock.names()
    for n in stock.names():
        assert ours.entries[n].counts.tolist() == stock.entries[n].counts.tolist() == [256]
        np.testing.assert_allclose(ours.entries[n].sums, stock.entries[n].sums, rtol=2e-3, err_msg=n)
