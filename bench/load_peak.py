"""Host memory of loading a model whole for training: the float teacher shared with the base
(training/setup.py float_teacher, now) against a deep copy of the base cast to the training dtype
(before). Each variant in its own child process, side by side in one run; peak RSS (VmHWM) after every
tensor of both models has been read (as quantizing the candidates and the teacher's forward read
them: a safetensors checkpoint is mmapped, and untouched pages would not count).

    .venv/bin/python bench/load_peak.py [--hidden 1536] [--layers 4] [--vocab 32768]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

_CHILD = """
import copy, sys, torch
from voodoo_quant.model.modeling import load_model
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.models import TORCH_DTYPES, load_models
d, dtype, how = sys.argv[1], sys.argv[2], sys.argv[3]
dt = TORCH_DTYPES[dtype]
if how == "shared":
    cfg = TrainConfig(model=d + "/model", data_dir=d + "/data", compression_ratio=0.6, dtype=dtype)
    base, teacher = load_models(cfg, dt)
else:
    base = load_model(d + "/model", dtype=torch.float32)
    teacher = copy.deepcopy(base).to(dt)
for m in (base, teacher):
    for p in m.parameters():
        float(p.sum())
print("PEAK_RSS", _hwm(), flush=True)
"""

# VmHWM, the new address space's own high-water mark: ru_maxrss would carry over the parent's
# (this script builds the model in memory) across fork and exec.
_HWM = """
def _hwm():
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
"""


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=32768)
    a = ap.parse_args()
    from qwen35 import save_qwen35, save_tokens

    with tempfile.TemporaryDirectory(prefix="voodoo-load-") as tmp:
        d = Path(tmp)
        save_qwen35(d / "model", a.hidden, a.layers, a.vocab, max_positions=1024)
        save_tokens(d / "data", a.vocab, 4, 64)
        base = subprocess.run([sys.executable, "-c", _HWM + "import torch, transformers, voodoo_quant.training.setup\n"
                               "print(_hwm())"], capture_output=True, text=True, cwd=ROOT, check=True)
        print(f"process baseline (imports): {int(base.stdout.split()[-1]) / 1e9:.2f} GB")
        for dtype in ("float32", "bfloat16"):
            peaks = {}
            for how in ("deepcopy", "shared"):
                p = subprocess.run([sys.executable, "-c", _HWM + _CHILD, str(d), dtype, how], capture_output=True, text=True,
                                   cwd=ROOT)
                line = [x for x in p.stdout.splitlines() if x.startswith("PEAK_RSS")]
                if p.returncode != 0 or not line:
                    raise SystemExit(p.stderr[-2000:])
                peaks[how] = float(line[-1].split()[1])
            print(f"{dtype:9} deep copy {peaks['deepcopy'] / 1e9:.2f} GB  shared/cast {peaks['shared'] / 1e9:.2f} GB  "
                  f"ratio {peaks['shared'] / peaks['deepcopy']:.2f}")


if __name__ == "__main__":
    main()
