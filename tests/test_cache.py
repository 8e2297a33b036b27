"""Candidate cache: hit, miss, corrupt entries (truncated, bit-flipped, bad meta) and a stale
libggml version are detected and rebuilt; bytes always equal a fresh libggml quantization."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from voodoo_quant.candidates.cache import META_FILE, CandidateCache, candidate, lib_version, matrix_hash
from voodoo_quant.core import ggml
from voodoo_quant.core.errors import QuantizationInputError


@pytest.fixture
def mat():
    return np.random.default_rng(7).standard_normal((32, 256)).astype(np.float32)


@pytest.fixture
def imat():
    return np.random.default_rng(8).uniform(0.1, 2.0, 256).astype(np.float32)


def test_miss_then_hit_bytes_equal_ggml(tmp_path, mat, imat):
    c = CandidateCache(tmp_path)
    fresh = ggml.lib().quantize(mat, "Q4_K", imat)
    assert c.get(c.key(mat, "Q4_K", imat)) is None
    assert c.stats.misses == 1
    assert c.get_or_build(mat, "Q4_K", imat) == fresh
    assert c.stats.built == 1
    again = CandidateCache(tmp_path)  # a new process/handle sees the entry
    assert again.get_or_build(mat, "Q4_K", imat) == fresh
    assert (again.stats.hits, again.stats.built) == (1, 0)
    meta = json.loads((again.entry_dir(again.key(mat, "Q4_K", imat)) / META_FILE).read_text())
    assert meta["shape"] == [32, 256] and meta["qtype"] == "Q4_K" and meta["lib_version"] == lib_version()


def test_key_separates_content_type_imatrix_version(mat, imat):
    k = CandidateCache.key(mat, "Q4_K", imat, "v1").digest
    other = mat.copy()
    other[3, 5] = np.nextafter(other[3, 5], np.float32(np.inf))  # one ulp
    assert CandidateCache.key(other, "Q4_K", imat, "v1").digest != k
    assert CandidateCache.key(mat, "Q5_K", imat, "v1").digest != k
    assert CandidateCache.key(mat, "Q4_K", None, "v1").digest != k
    assert CandidateCache.key(mat, "Q4_K", imat * 2, "v1").digest != k
    assert CandidateCache.key(mat, "Q4_K", imat, "v2").digest != k
    assert CandidateCache.key(mat.copy(), "Q4_K", imat.copy(), "v1").digest == k
    # Same bytes, different shape → different content hash.
    assert matrix_hash(mat.reshape(64, 128)) != matrix_hash(mat)


@pytest.mark.parametrize("damage", ["truncate", "bitflip", "meta_sha", "meta_garbage", "no_data"])
def test_corrupt_entry_is_dropped_and_rebuilt(tmp_path, mat, imat, damage):
    c = CandidateCache(tmp_path)
    good = c.get_or_build(mat, "Q6_K", imat)
    key = c.key(mat, "Q6_K", imat)
    data_p, meta_p = c.data_path(key), c.entry_dir(key) / META_FILE
    if damage == "truncate":
        data_p.write_bytes(good[:-1])
    elif damage == "bitflip":
        b = bytearray(good)
        b[len(b) // 2] ^= 0x10
        data_p.write_bytes(bytes(b))
    elif damage == "meta_sha":
        m = json.loads(meta_p.read_text())
        m["sha256"] = "0" * 64
        meta_p.write_text(json.dumps(m))
    elif damage == "meta_garbage":
        meta_p.write_text("{not json")
    else:
        data_p.unlink()
    c2 = CandidateCache(tmp_path)
    assert c2.get(key) is None
    assert c2.stats.corrupt == 1
    assert not c2.entry_dir(key).exists()  # deleted
    assert c2.get_or_build(mat, "Q6_K", imat) == good
    assert c2.stats.built == 1
    assert CandidateCache(tmp_path).get(key) == good


def test_stale_libggml_version_is_rebuilt(tmp_path, mat):
    c = CandidateCache(tmp_path)
    stale = c.key(mat, "Q8_0", None, "0.0.1+deadbeef")
    c.put(stale, b"\0" * stale.nbytes)  # what an old library "produced"
    assert c.get(stale) == b"\0" * stale.nbytes  # the old entry is self-consistent
    current = c.key(mat, "Q8_0")
    assert current.lib_version == lib_version() != stale.lib_version
    assert c.get(current) is None  # never served to the current library
    assert c.get_or_build(mat, "Q8_0") == ggml.lib().quantize(mat, "Q8_0")
    # An entry whose meta claims another version under the current key is refused too.
    meta_p = c.entry_dir(current) / META_FILE
    m = json.loads(meta_p.read_text())
    m["lib_version"] = "0.0.1+deadbeef"
    meta_p.write_text(json.dumps(m))
    assert c.get(current) is None and c.stats.corrupt == 1


def test_put_refuses_wrong_length_and_key_refuses_bad_rows(tmp_path, mat):
    c = CandidateCache(tmp_path)
    k = c.key(mat, "Q4_0")
    with pytest.raises(QuantizationInputError, match="expected"):
        c.put(k, b"\0" * (k.nbytes - 1))
    with pytest.raises(QuantizationInputError, match="block size"):
        c.key(np.zeros((4, 96), np.float32), "Q4_K")
    with pytest.raises(QuantizationInputError, match="one per column"):
        c.key(mat, "Q4_K", np.ones(128, np.float32))


def test_candidate_is_to_float_in_training_dtype(tmp_path, mat):
    c = CandidateCache(tmp_path)
    data = c.get_or_build(mat, "Q5_K")
    ref = ggml.lib().dequantize(data, "Q5_K", mat.shape)
    got32 = candidate(data, "Q5_K", mat.shape)
    assert got32.dtype == torch.float32 and np.array_equal(got32.numpy(), ref)
    got16 = candidate(data, "Q5_K", mat.shape, torch.bfloat16)
    assert got16.dtype == torch.bfloat16
    assert torch.equal(got16, torch.from_numpy(ref).to(torch.bfloat16))
