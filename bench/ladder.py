"""Ladder cost: a three-size `voodoo quantize` ladder against one size, on the embedded default.

Runs ``configs/cpu_smollm2_demo.sh`` (exactly what ``make demo`` runs: SmolLM2-135M + the plays,
10 steps at seq 256, stock Q4_0 IQ4_XS Q4_K_M Q8_0) from an empty output dir and an empty
candidate cache with one size, then the same command with three sizes into the same output dir:
the second run skips every step the sizes share (data, teacher, reference, imatrix, candidate
cache, stock files, the eval base) and does only the two new sizes' training, export and eval,
reusing the sensitivity table and the cached teacher forward. So

    cost(ladder of 3) = t(first run) + t(second run)   (every step of a from-scratch ladder, once;
                                                       plus one more preflight and process start)
    ratio = cost(ladder of 3) / t(first run)           (target <= 2.2)

Both runs are measured back to back in this one process, in wall seconds and in CPU seconds of
the child processes (user + system, which other jobs on a shared machine disturb much less than
the wall clock); the step seconds come from the ladder's own step records (``work/manifests``).
Absolute seconds depend on the machine's load; the ratios are the numbers.

    .venv/bin/python bench/ladder.py --out runs/bench-ladder [--single 65] [--sizes 55 65 75]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _cpu_children() -> float:
    r = resource.getrusage(resource.RUSAGE_CHILDREN)
    return r.ru_utime + r.ru_stime


def run_demo(out: Path, sizes: list[int], cache: Path, log: Path) -> tuple[float, float]:
    """(wall s, CPU s) of one demo run."""
    env = dict(os.environ, OUT=str(out), SIZES=" ".join(map(str, sizes)), VOODOO_CACHE_DIR=str(cache))
    c0 = _cpu_children()
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run(["bash", str(ROOT / "configs" / "cpu_smollm2_demo.sh")], stdout=fh, stderr=subprocess.STDOUT,
                            env=env, cwd=ROOT).returncode
    dt = time.perf_counter() - t0
    if rc:
        raise SystemExit(f"the demo failed (exit {rc}); see {log}")
    return dt, _cpu_children() - c0


def step_seconds(out: Path) -> dict[str, float]:
    d = {}
    for p in sorted((out / "work" / "manifests").glob("*.json")):
        r = json.loads(p.read_text())
        if r.get("complete") and "seconds" in r:
            d[r["step"]] = r["seconds"]
    return d


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-ladder")
    ap.add_argument("--single", type=int, default=65)
    ap.add_argument("--sizes", type=int, nargs="+", default=[55, 65, 75])
    ap.add_argument("--keep", action="store_true", help="keep an existing --out (default: start from empty)")
    a = ap.parse_args()
    if a.single not in a.sizes:
        raise SystemExit("--single must be one of --sizes")
    if a.out.exists() and not a.keep:
        shutil.rmtree(a.out)
    a.out.mkdir(parents=True, exist_ok=True)
    ladder, cache = a.out / "ladder", a.out / "cache"
    t1, c1 = run_demo(ladder, [a.single], cache, a.out / "run1.log")
    s1 = step_seconds(ladder)
    t2, c2 = run_demo(ladder, a.sizes, cache, a.out / "run2.log")
    s2 = step_seconds(ladder)
    new = {k: v for k, v in s2.items() if s1.get(k) != v}
    report = {
        "command": f".venv/bin/python bench/ladder.py --out {a.out} --single {a.single} --sizes {' '.join(map(str, a.sizes))}",
        "single_size_s": round(t1, 1), "extra_sizes_s": round(t2, 1), "ladder_s": round(t1 + t2, 1),
        "ladder_over_single": round((t1 + t2) / t1, 3), "single_size_cpu_s": round(c1, 1),
        "extra_sizes_cpu_s": round(c2, 1), "ladder_over_single_cpu": round((c1 + c2) / c1, 3),
        "load_average_at_end": os.getloadavg(), "steps_first_run_s": s1, "steps_second_run_s": new,
    }
    (a.out / "report.json").write_text(json.dumps(report, indent=2) + "\n")
    print(json.dumps(report, indent=2))
    print(f"\nladder of {len(a.sizes)} / one size = ({t1:.0f} + {t2:.0f}) / {t1:.0f} s = {(t1 + t2) / t1:.2f}x wall, "
          f"({c1:.0f} + {c2:.0f}) / {c1:.0f} s = {(c1 + c2) / c1:.2f}x CPU (target <= 2.2)")


if __name__ == "__main__":
    sys.path.insert(0, str(ROOT))
    main()
