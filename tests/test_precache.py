"""Parallel candidate-cache builder: a 2-process build equals the in-process build byte for
byte (and a fresh libggml quantization), a second run is all hits, a corrupt entry is rebuilt."""

from __future__ import annotations

import numpy as np
import pytest

from voodoo_quant.candidates.cache import CandidateCache
from voodoo_quant.candidates.precache import CandidateJob, QuantPool, build_all, job_cost
from voodoo_quant.core.errors import ConfigError

# IQ3_S/IQ3_XXS make the workers initialize IQ grids in their initializer; IQ1/IQ2 types would
# cost seconds of init per process (docs/facts.md), too slow for CI.
TYPES = ("Q8_0", "Q4_K", "Q6_K", "IQ3_S", "IQ3_XXS")


def _jobs():
    rng = np.random.default_rng(11)
    mats = {
        "blk.0.ffn_down.weight": rng.standard_normal((48, 512)).astype(np.float32),
        "blk.0.attn_q.weight": rng.standard_normal((64, 256)).astype(np.float32),
    }
    ims = {n: rng.uniform(0.1, 3.0, m.shape[1]).astype(np.float32) for n, m in mats.items()}
    jobs = []
    for n, m in mats.items():
        for t in TYPES:
            # One tensor comes through a provider (lazy loading), the other as an array.
            src = {"matrix": m} if "ffn" in n else {"provider": (lambda m=m: m)}
            jobs.append(CandidateJob(n, t, imatrix=ims[n], **src))
    return jobs, mats, ims


def test_two_workers_equal_one_worker_and_ggml(tmp_path, ggml_lib):
    jobs, mats, ims = _jobs()
    one = build_all(jobs, CandidateCache(tmp_path / "one"), workers=1, progress=False)
    two = build_all(jobs, CandidateCache(tmp_path / "two"), workers=2, progress=True)
    assert (one.cached, one.built, two.cached, two.built) == (0, 10, 0, 10)
    assert set(one.paths) == set(two.paths) == {(n, t) for n in mats for t in TYPES}
    for jk in one.paths:
        a, b = one.paths[jk].read_bytes(), two.paths[jk].read_bytes()
        assert a == b, jk
        assert a == ggml_lib.quantize(mats[jk[0]], jk[1], ims[jk[0]]), jk
    assert one.bytes_built == two.bytes_built == sum(p.stat().st_size for p in one.paths.values())
    # Nothing but entries is left in the cache root (the matrix hand-off files are gone).
    assert not [p for p in (tmp_path / "two").iterdir() if p.name.startswith(".precache-")]

    # Second run: everything is found up front, nothing is built.
    again = build_all(jobs, CandidateCache(tmp_path / "two"), workers=2, progress=False)
    assert (again.cached, again.built, again.bytes_built) == (10, 0, 0)

    # A damaged entry is noticed and only that one is rebuilt, through a reused pool.
    victim = two.paths[("blk.0.attn_q.weight", "IQ3_S")]
    good = victim.read_bytes()
    victim.write_bytes(good[:-5])
    with QuantPool(2, TYPES) as pool:
        fixed = build_all(jobs, CandidateCache(tmp_path / "two"), pool=pool, progress=False)
    assert (fixed.cached, fixed.built) == (9, 1)
    assert victim.read_bytes() == good


def test_worker_errors_surface_typed_and_jobs_are_validated(tmp_path):
    m = np.zeros((4, 256), np.float32)
    m[0, 0] = np.nan
    with pytest.raises(Exception, match="non-finite"):
        build_all([CandidateJob("bad", "Q4_K", matrix=m)], CandidateCache(tmp_path), workers=2, progress=False)
    with pytest.raises(ConfigError, match="exactly one"):
        CandidateJob("x", "Q4_K")
    ok = np.ones((4, 256), np.float32)
    with pytest.raises(ConfigError, match="duplicate"):
        build_all([CandidateJob("x", "Q4_K", matrix=ok)] * 2, CandidateCache(tmp_path), workers=1, progress=False)


def test_scheduling_costs_put_slow_types_first():
    n = 4096 * 4096
    assert job_cost("IQ3_S", n, False) > job_cost("Q4_K", n, True) > job_cost("Q4_K", n, False) > job_cost("Q8_0", n, False)
    assert job_cost("Q4_K", 2 * n, False) == 2 * job_cost("Q4_K", n, False)


def _gone(pid: int) -> bool:
    """No such process, or a zombie nobody reaps (the container's init may not)."""
    import os

    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    try:
        with open(f"/proc/{pid}/status") as f:
            return any(line.startswith("State:") and "Z" in line.split()[1] for line in f)
    except FileNotFoundError:
        return True


@pytest.mark.skipif(not __import__("sys").platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_killed_run_takes_its_busy_pool_workers_with_it(tmp_path):
    """A run killed with SIGKILL (no cleanup runs) while a pool worker is in a job leaves no
    worker behind: the job would otherwise run to its end (here 120 s)."""
    import subprocess
    import sys
    import textwrap
    import time

    script = tmp_path / "run.py"
    script.write_text(textwrap.dedent("""
        import os, signal, sys, time
        from voodoo_quant.candidates.precache import QuantPool
        if __name__ == "__main__":
            pool = QuantPool(1)
            print(pool.submit(os.getpid).result(), flush=True)
            pool.submit(time.sleep, 120)
            time.sleep(1.0)
            os.kill(os.getpid(), signal.SIGKILL)
    """))
    run = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    worker = int(run.stdout.readline())  # not read to its end: an orphaned worker would hold the pipe open
    run.wait(timeout=120)
    run.stdout.close()
    deadline = time.monotonic() + 20
    while not _gone(worker) and time.monotonic() < deadline:
        time.sleep(0.2)
    gone = _gone(worker)
    if not gone:
        __import__("os").kill(worker, 9)
    assert gone, "the pool's worker outlived the killed run"
