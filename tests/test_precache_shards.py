"""`voodoo precache --shard i/n` and concurrent writers of one cache directory.

Two shards fill exactly the entries (same files, same bytes) that one unsharded run fills; two
processes building the same candidates into one directory at the same time both succeed and leave
every entry intact (checksum verified), byte-equal to a fresh single-process build."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from voodoo_quant.candidates.precache import parse_shard, split_by_cost
from voodoo_quant.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MENU = "Q8_0,Q4_K,Q6_K,Q4_0"


def _entries(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("data.bin"))}


def _precache(model: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VOODOO_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "VOODOO_QUANT_WORKERS": "1"}
    return subprocess.run([sys.executable, "-m", "voodoo_quant.cli.app", "precache", "--model", str(model),
                           "--candidate_types", MENU, "--workers", "1", *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def test_split_by_cost_is_a_balanced_partition():
    costs = {f"t{i}": float(c) for i, c in enumerate([9, 7, 5, 4, 4, 3, 1, 1])}
    parts = [split_by_cost(costs, i, 3) for i in (1, 2, 3)]
    assert set().union(*parts) == set(costs) and sum(len(p) for p in parts) == len(costs)
    loads = [sum(costs[k] for k in p) for p in parts]
    assert max(loads) - min(loads) <= max(costs.values())
    assert parts == [split_by_cost(costs, i, 3) for i in (1, 2, 3)]  # every process computes the same
    assert parse_shard("2/4") == (2, 4) and parse_shard(None) is None
    for bad in ("0/2", "3/2", "a/b", "2"):
        with pytest.raises(ConfigError):
            parse_shard(bad)


def test_two_shards_fill_exactly_what_one_run_fills(gate_model_dir, tmp_path, ggml_lib):
    model = gate_model_dir / "model"
    whole = _precache(model, tmp_path / "one")
    assert whole.returncode == 0, whole.stderr[-2000:]
    a = _precache(model, tmp_path / "two", "--shard", "1/2")
    assert a.returncode == 0, a.stderr[-2000:]
    first = _entries(tmp_path / "two" / "candidates")
    b = _precache(model, tmp_path / "two", "--shard", "2/2")
    assert b.returncode == 0, b.stderr[-2000:]
    assert "shard 2/2" in b.stdout
    both = _entries(tmp_path / "two" / "candidates")
    one = _entries(tmp_path / "one" / "candidates")
    assert 0 < len(first) < len(both)  # each shard built a real part
    assert both == one
    again = _precache(model, tmp_path / "two")  # the union is complete: nothing left to build
    assert again.returncode == 0 and ", 0 built" in again.stdout, again.stdout


_WRITER = """
import sys
import numpy as np
from voodoo_quant.candidates.cache import CandidateCache
from voodoo_quant.candidates.precache import CandidateJob, build_all
rng = np.random.default_rng(5)
jobs = []
for i in range(6):
    m = rng.standard_normal((64, 512)).astype(np.float32)
    for t in ("Q8_0", "Q4_K", "Q6_K", "Q4_0"):
        jobs.append(CandidateJob(f"t{i}", t, matrix=m))
rep = build_all(jobs, CandidateCache(sys.argv[1]), workers=1, progress=False)
print("built", rep.built, "cached", rep.cached)
"""


def test_concurrent_writers_keep_the_cache_consistent(tmp_path, ggml_lib):
    from voodoo_quant.candidates.cache import CandidateCache

    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    shared = tmp_path / "shared"
    procs = [subprocess.Popen([sys.executable, "-c", _WRITER, str(shared)], stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True, env=env) for _ in range(2)]
    outs = [p.communicate(timeout=600) for p in procs]
    for p, (out, err) in zip(procs, outs):
        assert p.returncode == 0, err[-2000:]
    ref = subprocess.run([sys.executable, "-c", _WRITER, str(tmp_path / "ref")], capture_output=True, text=True,
                         env=env, timeout=600)
    assert ref.returncode == 0 and "built 24" in ref.stdout
    assert _entries(shared) == _entries(tmp_path / "ref")
    cache = CandidateCache(shared)
    for d in sorted(p.parent for p in shared.rglob("data.bin")):
        meta = __import__("json").loads((d / "meta.json").read_text())
        data = (d / "data.bin").read_bytes()
        assert __import__("hashlib").sha256(data).hexdigest() == meta["sha256"]
    assert not list(shared.rglob("*.tmp"))  # no temporaries left behind
    assert cache.root == shared
    assert np.sum([len(v) for v in _entries(shared).values()]) > 0
