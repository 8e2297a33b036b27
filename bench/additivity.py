"""Is the knapsack's additive model right? The measured KL of whole assignments against the sum of
their tensors' single-tensor ΔKLs (a ``--sensitivity_kind measured`` table), and the Fisher table
against the measured one, class by class.

    .venv/bin/python bench/additivity.py --out runs/q3 --measured runs/q3x/measured70/sensitivity.pt \\
        --fisher runs/q3/runs/sensitivity70/seed0/sensitivity.pt ASSIGNMENT.json [ASSIGNMENT.json ...]

The joint KL is measured on the table's calibration sequences (the first 4 of the train tokens)
and on 8 other train sequences (100..107), against the float model, with ``objective.HeldAside``.
"""

from __future__ import annotations

import argparse
import json
import math
import re
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _table(path: Path) -> tuple[dict, dict]:
    import torch

    d = torch.load(path, weights_only=True)
    return json.loads(d["table_json"]), json.loads(d["menus_json"])


def compare(measured: dict, other: dict, menus: dict) -> None:
    def cls(n: str) -> str:
        return re.sub(r"layers\.\d+\.", "", n).replace("model.", "").replace(".weight", "")

    by: dict[str, list[float]] = {}
    logs = []
    for n in measured:
        for a, b in zip(other[n], measured[n]):
            by.setdefault(cls(n), []).append(b / a)
            logs.append(math.log(b / a))
    for c, r in sorted(by.items()):
        r = sorted(r)
        print(f"{c:20} n={len(r):4d}  measured/predicted median {statistics.median(r):5.2f}  "
              f"10-90 % [{r[len(r) // 10]:.2f}, {r[9 * len(r) // 10]:.2f}]")
    print(f"RMS log error {math.sqrt(sum(x * x for x in logs) / len(logs)):.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, required=True, help="a bench/quality.py directory")
    ap.add_argument("--measured", type=Path, required=True, help="sensitivity.pt of a --sensitivity_kind measured run")
    ap.add_argument("--fisher", type=Path, default=None, help="sensitivity.pt of a Fisher run, to compare tables")
    ap.add_argument("assignments", nargs="*", type=Path)
    a = ap.parse_args()
    import torch

    from voodoo_quant.core import ggml
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.objective import HeldAside
    from voodoo_quant.training.setup import (
        candidate_sources, imatrix_vectors, load_imatrix, load_tokens, plan_run, reader_weights,
    )

    table, menus = _table(a.measured)
    if a.fisher:
        compare(table, _table(a.fisher)[0], menus)
    if not a.assignments:
        return
    torch.set_grad_enabled(False)
    settings = json.loads((a.out / "settings.json").read_text())
    cfg = TrainConfig(model=str(a.out / "hf"), data_dir=str(a.out / "data"), imatrix=str(a.out / "imatrix.gguf"),
                      compression_ratio=0.7, seq_len=settings["seq_len"], candidate_types=tuple(settings["menu"]),
                      method="sensitivity")
    model = load_model(cfg.model, dtype=torch.float32).eval()
    teacher = load_model(cfg.model, dtype=torch.float32).eval()
    imx = load_imatrix(cfg)
    _, plans, _ = plan_run(cfg, model, imx)
    tokens = load_tokens(cfg.data_path, cfg.seq_len)
    sources = candidate_sources(plans, reader_weights(teacher, plans), imatrix_vectors(imx, plans))
    modules, lib = dict(model.named_modules()), ggml.lib()
    params = dict(model.named_parameters())
    for path in a.assignments:
        chosen = json.loads(path.read_text())["tensors"]
        total = 0.0
        for p in plans:
            t = chosen[p.name]["qtype"]
            k = p.menu.types.index(t)
            total += table[p.name][k]
            deq = lib.dequantize(sources(p)[k], t, (p.rows, p.n_per_row), name=p.name)
            w = modules[p.modules[0]].weight
            w.copy_(p.layout.from_gguf(torch.from_numpy(deq)).reshape(w.shape))
        for name, tok in (("calibration 0..3", tokens[:4]), ("train 100..107", tokens[100:108])):
            m = HeldAside(model, teacher, tok, device=torch.device("cpu")).measure()
            print(f"{path}: {name}: joint KL {m.kl:.6f} ± {m.stderr:.6f}, sum of single ΔKLs {total:.6f}")
        for n, t in teacher.named_parameters():
            params[n].copy_(t)


if __name__ == "__main__":
    main()
