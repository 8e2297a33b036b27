"""Build the candidate cache in parallel: one long-lived process pool over (tensor, type) jobs.

Quantization is pure-CPU ggml work. Processes (not threads) run whole jobs side by side; every
worker loads libggml-base once and initializes the IQ grids it will need once (seconds each,
``ggml_quantize_init``), so the pool is created once per build and reused for every job.

A matrix travels to the workers as a ``.npy`` file under the cache root (written once per
tensor, memory-mapped by each worker, deleted when its last type is done), never as a pickled
blob per type; workers write the cache entry themselves and send back only sizes and timings.
"""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from concurrent.futures import FIRST_COMPLETED, Future, ProcessPoolExecutor, wait
from dataclasses import dataclass
from multiprocessing import get_context
from pathlib import Path
from typing import Any, Callable, Iterable

import numpy as np

from ..core import envs, ggml
from ..core import qtypes as qt
from ..core.errors import ConfigError, QuantizationInputError
from .cache import CacheKey, CandidateCache, lib_version, matrix_hash
from .compensate import quantize_compensated, release_factors

# Relative single-thread seconds per 4096×4096 matrix (docs/facts.md, quantizer speed), used only to
# schedule the slowest jobs first and to weigh the progress bar; not a measurement of this run.
_COST = {
    "Q8_0": 0.05, "Q6_K": 0.42, "Q5_K": 0.7, "Q4_K": 0.8, "Q3_K": 0.17, "Q2_K": 0.7,
    "IQ4_XS": 2.8, "IQ3_S": 4.3, "IQ2_S": 2.7, "IQ2_XXS": 4.0, "IQ1_S": 2.4,
    "IQ3_XXS": 4.0, "IQ2_XS": 4.0, "IQ1_M": 2.4, "IQ4_NL": 2.8,
}
_COST_IMATRIX = {"Q5_K": 1.4, "Q4_K": 1.4, "Q3_K": 0.5, "Q2_K": 1.7}
_DEFAULT_COST = 0.1
_REF_ELEMENTS = 4096 * 4096


@dataclass
class CandidateJob:
    """One candidate to build: tensor `name` (its matrix in GGUF layout, float32, 2-D, or a
    callable returning it) in `qtype`, with the imatrix vector or None, and the error
    compensation (compensate.py) or None."""

    name: str
    qtype: str
    matrix: np.ndarray | None = None
    provider: Callable[[], np.ndarray] | None = None
    imatrix: np.ndarray | None = None
    compensation: Any = None

    def __post_init__(self) -> None:
        self.qtype = qt.get(self.qtype).name
        if (self.matrix is None) == (self.provider is None):
            raise ConfigError(f"job {self.name}/{self.qtype}: give exactly one of matrix or provider")

    def load(self) -> np.ndarray:
        m = self.matrix if self.matrix is not None else self.provider()
        m = np.ascontiguousarray(m, dtype=np.float32)
        if m.ndim != 2:
            raise QuantizationInputError(f"{self.name}: candidate matrix must be 2-D, got {m.shape}")
        return m


def job_cost(qtype: str, n_elements: int, with_imatrix: bool) -> float:
    q = qt.get(qtype).name
    c = (_COST_IMATRIX.get(q) if with_imatrix else None) or _COST.get(q, _DEFAULT_COST)
    return c * n_elements / _REF_ELEMENTS


# -- worker side ---------------------------------------------------------------------------------
def _die_with_parent(parent: int) -> None:
    """Have the kernel stop this worker when the thread that made the pool (the product makes
    its pools on the main thread) dies (Linux ``PR_SET_PDEATHSIG``; elsewhere nothing): a run that
    is killed would otherwise leave its workers on their current job, a compensated walk of a
    large tensor for minutes."""
    import ctypes
    import signal
    import sys

    if not sys.platform.startswith("linux"):
        return
    try:
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # 1 = PR_SET_PDEATHSIG
    except (OSError, AttributeError):  # no prctl to call: the worker ends with its job, as before
        return
    if os.getppid() != parent:  # the parent died before the signal was set
        os.kill(os.getpid(), signal.SIGTERM)


def _worker_init(lib_path: str | None, iq_types: tuple[str, ...], parent: int | None = None) -> None:
    if parent is not None:
        _die_with_parent(parent)
    lib = ggml.lib(lib_path)
    for t in iq_types:
        lib._ensure_init(qt.get(t))


def _worker_build(root: str, npy: str, key: CacheKey, imatrix: np.ndarray | None, name: str,
                  lib_path: str | None, compensation=None) -> tuple[int, float]:
    t0 = time.perf_counter()
    m = np.load(npy, mmap_mode="r")
    data = quantize_compensated(np.ascontiguousarray(m), key.qtype, imatrix, compensation, lib=ggml.lib(lib_path),
                                name=name, workers=1)
    CandidateCache(root).put(key, data, {"name": name})
    return len(data), time.perf_counter() - t0


class QuantPool:
    """A long-lived process pool whose workers hold libggml-base with IQ grids initialized.

    Use as a context manager, or pass to :func:`build_all` to reuse it across builds."""

    def __init__(self, workers: int, iq_types: Iterable[str] = (), lib_path: str | Path | None = None):
        self.workers = int(workers)
        if self.workers < 1:
            raise ConfigError(f"workers must be >= 1, got {workers}")
        self.lib_path = str(lib_path) if lib_path else None
        iq = tuple(sorted({qt.get(t).name for t in iq_types if qt.get(t).name.startswith("IQ")}))
        # spawn: forking a process that already runs torch/OpenMP threads can deadlock.
        self._ex = ProcessPoolExecutor(max_workers=self.workers, mp_context=get_context("spawn"),
                                       initializer=_worker_init, initargs=(self.lib_path, iq, os.getpid()))

    def submit(self, fn, *args) -> Future:
        return self._ex.submit(fn, *args)

    def close(self) -> None:
        self._ex.shutdown(wait=True, cancel_futures=True)

    def __enter__(self) -> "QuantPool":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


@dataclass
class BuildReport:
    paths: dict[tuple[str, str], Path]  # (name, qtype) → cached data.bin
    keys: dict[tuple[str, str], CacheKey]
    cached: int  # jobs found in the cache up front
    built: int
    bytes_built: int
    seconds: float


def build_all(
    jobs: list[CandidateJob],
    cache: CandidateCache,
    *,
    workers: int | None = None,
    progress: bool = True,
    pool: QuantPool | None = None,
    version: str | None = None,
) -> BuildReport:
    """Make sure every job's candidate is in `cache`; return where each one lies.

    Already-cached jobs are skipped up front; the rest run slowest first (type cost × size) on
    one pool of `workers` processes (default ``VOODOO_QUANT_WORKERS``). With one worker and no
    pool the jobs run in this process, on one thread."""
    t_start = time.perf_counter()
    seen: set[tuple[str, str]] = set()
    for j in jobs:
        if (j.name, j.qtype) in seen:
            raise ConfigError(f"duplicate candidate job {j.name}/{j.qtype}")
        seen.add((j.name, j.qtype))
    version = version or lib_version()
    n_workers = pool.workers if pool else (workers or envs.quant_workers())

    # Group by tensor so each matrix is loaded and hashed once for all of its types.
    by_tensor: dict[str, list[CandidateJob]] = {}
    for j in jobs:
        by_tensor.setdefault(j.name, []).append(j)

    keys: dict[tuple[str, str], CacheKey] = {}
    todo: list[tuple[float, str, CandidateJob, CacheKey]] = []
    shapes: dict[str, tuple[int, int]] = {}
    for name, group in by_tensor.items():
        m = group[0].load()
        shapes[name] = m.shape
        content = matrix_hash(m)
        for j in group:
            k = CandidateCache.key(m, j.qtype, j.imatrix, version, content=content, compensation=j.compensation)
            keys[(name, j.qtype)] = k
            if not cache.contains(k):
                todo.append((job_cost(j.qtype, m.size, j.imatrix is not None), name, j, k))
        del m
    cached = len(jobs) - len(todo)
    todo.sort(key=lambda t: (-t[0], t[1], t[2].qtype))  # slowest first, then a stable order

    bytes_built = 0
    with _Progress(progress, todo, cached) as bar:
        if todo and n_workers == 1 and pool is None:
            try:
                for _cost, name, j, k in todo:
                    data = cache.get_or_build(j.load(), j.qtype, j.imatrix, name=name, key=k, workers=1,
                                              compensation=j.compensation)
                    bytes_built += len(data)
                    bar.advance(_cost, len(data))
            finally:
                release_factors()  # kept for a tensor's next type, not through the run that follows
        elif todo:
            bytes_built = _run_pool(todo, cache, pool, n_workers, bar)

    paths = {jk: cache.data_path(k) for jk, k in keys.items()}
    missing = [f"{n}/{t}" for (n, t), k in keys.items() if not cache.contains(k)]
    if missing:
        raise QuantizationInputError(f"candidate cache is missing {len(missing)} candidate(s) after the build: {missing[:5]}")
    return BuildReport(paths, keys, cached, len(todo), bytes_built, time.perf_counter() - t_start)


def _run_pool(todo, cache: CandidateCache, pool: QuantPool | None, n_workers: int, bar: "_Progress") -> int:
    """Run `todo` on the pool, a tensor at a time: a tensor's matrix is written once to a ``.npy``
    hand-off file, all its types are submitted, and at most ``2 × workers`` such files exist at
    once, so the scratch disk holds a few matrices, not the model (27B: 108 GB in float32)."""
    own = pool is None
    if own:
        pool = QuantPool(n_workers, {j.qtype for _, _, j, _ in todo})
    tmp = Path(tempfile.mkdtemp(prefix=".precache-", dir=_mkdir(cache.root)))
    by_name: dict[str, list] = {}
    for item in todo:  # slowest job first, so tensors are taken in order of their slowest job
        by_name.setdefault(item[1], []).append(item)
    remaining = {name: len(items) for name, items in by_name.items()}
    limit = 2 * pool.workers
    files: dict[str, Path] = {}
    bytes_built = 0
    pending: dict[Future, tuple[float, str]] = {}

    def collect() -> None:
        nonlocal bytes_built
        done, _ = wait(pending, return_when=FIRST_COMPLETED)
        for f in done:
            cost, name = pending.pop(f)
            nbytes, _secs = f.result()  # re-raises a worker's typed error
            bytes_built += nbytes
            bar.advance(cost, nbytes)
            remaining[name] -= 1
            if remaining[name] == 0:
                files.pop(name).unlink(missing_ok=True)

    try:
        for i, (name, items) in enumerate(by_name.items()):
            while len(files) >= limit:
                collect()
            files[name] = tmp / f"{i}.npy"
            np.save(files[name], items[0][2].load())
            for cost, _n, j, k in items:
                f = pool.submit(_worker_build, str(cache.root), str(files[name]), k, j.imatrix, name, pool.lib_path,
                                j.compensation)
                pending[f] = (cost, name)
        while pending:
            collect()
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
        if own:
            pool.close()
    return bytes_built


def parse_shard(spec: str | None) -> tuple[int, int] | None:
    """``"i/n"`` (1 <= i <= n) -> (i, n); None for None."""
    if spec is None:
        return None
    try:
        i, n = (int(x) for x in str(spec).split("/"))
    except ValueError:
        raise ConfigError(f"--shard {spec!r}: expected i/n, e.g. 1/4") from None
    if n < 1 or not 1 <= i <= n:
        raise ConfigError(f"--shard {spec}: need 1 <= i <= n")
    return i, n


def split_by_cost(costs: dict[str, float], index: int, count: int) -> set[str]:
    """The keys of shard `index` (1-based) of `count`: keys dealt largest first to the least-loaded
    shard (ties to the lowest shard, keys in sorted order), so every key is in exactly one shard,
    the shards' costs are balanced, and every process computes the same split on its own."""
    load = [0.0] * count
    mine: set[str] = set()
    for key in sorted(costs, key=lambda k: (-costs[k], k)):
        s = min(range(count), key=lambda j: (load[j], j))
        load[s] += costs[key]
        if s == index - 1:
            mine.add(key)
    return mine


def _mkdir(p: Path) -> Path:
    p.mkdir(parents=True, exist_ok=True)
    return p


class _Progress:
    """A rich progress bar over jobs (weighted by estimated cost): jobs, bytes written, ETA."""

    def __init__(self, enabled: bool, todo, cached: int):
        self.enabled = enabled and bool(todo)
        self.total_jobs = len(todo)
        self.cached = cached
        self.done_jobs = 0
        self.done_bytes = 0
        self.total_cost = sum(t[0] for t in todo) or 1.0

    def __enter__(self) -> "_Progress":
        if self.enabled:
            from rich.progress import BarColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn

            self._p = Progress(
                TextColumn("[bold]candidates"), BarColumn(),
                TextColumn("{task.fields[jobs]}"), TextColumn("{task.fields[mb]}"),
                TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                transient=False,
            )
            self._p.start()
            self._task = self._p.add_task("build", total=self.total_cost, jobs=self._jobs(), mb="0.0 MB")
        return self

    def _jobs(self) -> str:
        return f"{self.done_jobs}/{self.total_jobs} built ({self.cached} cached)"

    def advance(self, cost: float, nbytes: int) -> None:
        self.done_jobs += 1
        self.done_bytes += nbytes
        if self.enabled:
            self._p.update(self._task, advance=cost, jobs=self._jobs(), mb=f"{self.done_bytes / 1e6:.1f} MB")

    def __exit__(self, *exc) -> None:
        if self.enabled:
            self._p.stop()

