"""Does polish help a knapsack? Measures, on a validation split of training sequences (never the
eval text), paired over sequences, three layouts of the same sensitivity table at each size:

- ``target+polish``: what ``voodoo train --method sensitivity`` writes (the greedy knapsack at the
  training target, baked and polished: ``methods.sensitivity_choice``; the guarantee's
  ``knapsack+polish``);
- ``upper``: the greedy knapsack straight to the budget's upper bound (the guarantee's ``knapsack``);
- ``upper+polish``: that, then polish.

    .venv/bin/python bench/knapsack_polish.py --out runs/q7 --sizes 50,60,70,80,90,95 --work /tmp/kp

Each size is rebuilt with the bench's own settings (``bench/quality.py``'s ``settings.json``) and
error compensation, so the candidates come from the same cache; the Fisher table of the bench's
``sensitivity_gptq<size>`` run is reused when it is there. The polished layouts are checked
against the recorded ``--method sensitivity`` assignment where one exists.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from search_transfer import paired, rebuild_config, validation_args  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    validation_args(ap)
    ap.add_argument("--sizes", default="50,60,70,80,90,95")
    ap.add_argument("--work", type=Path, required=True, help="scratch directory for the rebuilt runs")
    ap.add_argument("--json", type=Path, default=None, help="write the per-size rows here")
    a = ap.parse_args()
    import torch

    from voodoo_quant.training.finalize import run_rungs
    from voodoo_quant.training.knapsack import greedy_layout, polish
    from voodoo_quant.training.methods import sensitivity_choice
    from voodoo_quant.training.objective import HeldAside
    from voodoo_quant.training.rungs import release, serve
    from voodoo_quant.training.setup import load_tokens
    from voodoo_quant.training.trainer import Trainer

    out_rows = []
    for size in [int(s) for s in a.sizes.split(",")]:
        src = a.out / "runs" / f"sensitivity_gptq{size}" / "seed0"
        cfg = rebuild_config(a.out, size, 0, src, a.work / f"s{size}", "kp.pt")
        torch.set_grad_enabled(True)  # the Fisher table of a size not in the bench is computed here
        run = Trainer(cfg).prepare()
        torch.set_grad_enabled(False)
        b = run.budget
        lower = b.target_bytes * (1 - b.tolerance)

        def polished(choice):
            return polish(run.plans, run.sensitivity, choice, lower=lower, upper=b.upper_bytes, upgrades=cfg.upgrades)

        tp = sensitivity_choice(run)  # what --method sensitivity writes
        up = greedy_layout(run.plans, run.sensitivity, b.upper_bytes)
        upp = polished(up)
        layouts = {"target+polish": tp, "upper": up, "upper+polish": upp.choice}
        by = {p.name: p for p in run.plans}
        recorded = src / "assignment.json"
        if recorded.is_file():
            rec = {n: t["qtype"] for n, t in json.loads(recorded.read_text())["tensors"].items()}
            mine = {n: by[n].menu.types[k] for n, k in tp.items()}
            diff = sum(rec.get(n) != t for n, t in mine.items())
            print(f"size {size}: target+polish differs from the recorded --method sensitivity file in {diff} tensors")
        rungs = run_rungs(run)
        val = load_tokens(cfg.data_path, cfg.seq_len)[a.val_start:a.val_start + a.val_sequences]
        valm = HeldAside(run.student, run.teacher, val, device=run.device, teacher_device=run.teacher_device,
                         chunk_tokens=cfg.loss_chunk_size)
        res = {}
        try:
            for label, ch in layouts.items():
                serve(rungs, ch)
                m = valm.measure()
                nbytes = sum(by[n].sizes[k] for n, k in ch.items())
                s = sum(run.sensitivity[n][k] for n, k in ch.items())
                res[label] = {"kl": m.kl, "se": m.stderr, "per_sequence": list(m.per_sequence), "bytes": nbytes,
                              "table_sum": s}
                print(f"size {size} {label:13s}: val KL {m.kl:.6f} ± {m.stderr:.6f}  bytes {nbytes:,}  Σs {s:.6f}",
                      flush=True)
        finally:
            release(rungs)
        ref = res["upper"]["per_sequence"]
        for label in ("target+polish", "upper+polish"):
            d, se = paired(res[label]["per_sequence"], ref)  # > 0: "upper" has the lower KL
            nd = sum(layouts[label][n] != up[n] for n in up)
            print(f"size {size}: upper vs {label}: drop {d:+.6f} ± {se:.6f} ({nd} tensors differ)", flush=True)
            res[label]["upper_drop"], res[label]["upper_drop_se"], res[label]["tensors_differ"] = d, se, nd
        res["polish_moves_upper"] = upp.moves
        out_rows.append({"size": size, **res})
        del run, rungs, valm
    if a.json:
        a.json.write_text(json.dumps(out_rows, indent=1))


if __name__ == "__main__":
    main()
