"""Do the final search's moves transfer? Replays a finished run's accepted moves and measures
every state on the search's own held-aside sequences and on a validation split of other training
sequences (never the eval text), paired over sequences.

    .venv/bin/python bench/search_transfer.py --out runs/q4 --run runs/q4/runs/voodoo_gptq70/seed0 \\
        --size 70 --seed 0 --work /tmp/st70

For each accepted move it prints the held-aside drop and its z (the paired drop over its standard
error: what ``--search_margin`` compares), and the drop on the validation split with its standard
error. A margin is worth its evaluations where moves above it still drop the validation KL.
The run is rebuilt with the bench's own train arguments (``bench/quality.py``), so the candidates
come from the same cache and the held-aside split is the run's (the last ``--search_sequences``).
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def paired(before, after) -> tuple[float, float]:
    """Mean per-sequence drop (before − after) and its standard error."""
    d = [b - a for b, a in zip(before, after)]
    m = sum(d) / len(d)
    var = sum((x - m) ** 2 for x in d) / (len(d) - 1)
    return m, math.sqrt(var / len(d))


def validation_args(ap: argparse.ArgumentParser) -> None:
    """The flags every rebuild-and-validate bench shares."""
    ap.add_argument("--out", type=Path, required=True, help="a bench/quality.py directory")
    ap.add_argument("--val_start", type=int, default=2000, help="first training sequence of the validation split")
    ap.add_argument("--val_sequences", type=int, default=64)


def rebuild_config(out: Path, size: int, seed: int, src: Path, work: Path, output_name: str):
    """The train config of a bench run at `size`, writing into `work`, with the run at `src`'s
    Hessians and sensitivity table copied over (reused, not recomputed: train checks their keys)."""
    from voodoo_quant.cli.train import build_config
    from voodoo_quant.candidates.hessian_store import FILE as HESSIANS_FILE
    from voodoo_quant.training.sensitivity import TABLE_NAME

    settings = json.loads((out / "settings.json").read_text())
    work.mkdir(parents=True, exist_ok=True)
    for f in (HESSIANS_FILE, TABLE_NAME):
        if (src / f).is_file() and not (work / f).is_file():
            shutil.copy(src / f, work / f)
    return build_config(model=str(out / "hf"), data_dir=str(out / "data"), imatrix=str(out / "imatrix.gguf"),
                        compression_ratio=size / 100, seq_len=settings["seq_len"], max_steps=settings["steps"],
                        candidate_types=tuple(settings["menu"]), seed=seed, output_dir=str(work),
                        output_name=output_name, error_compensation="gptq")


def short(name: str) -> str:
    return name.replace("model.", "").replace(".weight", "")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    validation_args(ap)
    ap.add_argument("--run", type=Path, required=True, help="a voodoo_gptq run of that bench (its search.json)")
    ap.add_argument("--size", type=int, required=True)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--work", type=Path, required=True, help="scratch output directory of the rebuilt run")
    ap.add_argument("--json", type=Path, default=None, help="write the per-move table here")
    a = ap.parse_args()
    import torch

    from voodoo_quant.training.finalize import run_rungs
    from voodoo_quant.training.guarantee import rung_bytes
    from voodoo_quant.training.objective import HeldAside
    from voodoo_quant.training.rungs import release, serve
    from voodoo_quant.training.setup import load_tokens
    from voodoo_quant.training.trainer import Trainer

    cfg = rebuild_config(a.out, a.size, a.seed, a.run, a.work, "transfer.pt")
    trainer = Trainer(cfg)
    run = trainer.prepare()
    torch.set_grad_enabled(False)
    by = {p.name: p for p in run.plans}
    rungs = run_rungs(run)

    search = json.loads((a.run / "search.json").read_text())
    types = dict(search["current"])
    for mv in reversed(search["accepted"]):  # undo the moves: the search's start
        for name, old, new in mv["changes"]:
            assert types[name] == new, (name, types[name], new)
            types[name] = old
    states = [dict(types)]
    for mv in search["accepted"]:
        for name, old, new in mv["changes"]:
            types[name] = new
        states.append(dict(types))
    for st in states:
        for n, t in st.items():
            if t not in rungs[n].types:  # a reference's off-menu type, as ``finalize.improve`` adds it
                if (n, t) not in run.extra_blobs:
                    raise SystemExit(f"{n}: {t} is neither on the menu {by[n].menu.types} nor a reference's type")
                rungs[n].add(t, rung_bytes(by[n], t))

    tokens = load_tokens(cfg.data_path, cfg.seq_len)
    val = tokens[a.val_start:a.val_start + a.val_sequences]
    held = HeldAside(run.student, run.teacher, run.held_tokens, device=run.device, teacher_device=run.teacher_device,
                     chunk_tokens=cfg.loss_chunk_size)
    valm = HeldAside(run.student, run.teacher, val, device=run.device, teacher_device=run.teacher_device,
                     chunk_tokens=cfg.loss_chunk_size)
    rows = []
    try:
        prev = None
        for i, st in enumerate(states):
            serve(rungs, {n: rungs[n].index(t) for n, t in st.items()})
            ma, mv = held.measure(), valm.measure()
            row = {"state": i, "held_kl": ma.kl, "val_kl": mv.kl, "val_se": mv.stderr,
                   "held_per_sequence": list(ma.per_sequence), "val_per_sequence": list(mv.per_sequence)}
            if prev is not None:
                dh, sh = paired(prev["held_per_sequence"], row["held_per_sequence"])
                dv, sv = paired(prev["val_per_sequence"], row["val_per_sequence"])
                mvd = search["accepted"][i - 1]
                row.update(held_drop=dh, held_z=dh / sh if sh > 0 else float("inf"), val_drop=dv, val_drop_se=sv,
                           changes=mvd["changes"], bytes=mvd["bytes"], recorded_held_kl=mvd["kl_after"])
                what = " ".join(f"{short(c[0])}:{c[1]}>{c[2]}" for c in mvd["changes"])
                print(f"move {i:2d}: held drop {dh:+.6f} (z {row['held_z']:5.2f})  val drop {dv:+.6f} ± {sv:.6f}  {what}",
                      flush=True)
            else:
                print(f"start: held KL {ma.kl:.6f} (recorded {search['start_kl']:.6f}), val KL {mv.kl:.6f} ± {mv.stderr:.6f}",
                      flush=True)
            rows.append(row)
            prev = row
    finally:
        release(rungs)
    dv, sv = paired(rows[0]["val_per_sequence"], rows[-1]["val_per_sequence"])
    dh, sh = paired(rows[0]["held_per_sequence"], rows[-1]["held_per_sequence"])
    print(f"whole search: held drop {dh:+.6f} ± {sh:.6f}, val drop {dv:+.6f} ± {sv:.6f} "
          f"(val KL {rows[0]['val_kl']:.6f} -> {rows[-1]['val_kl']:.6f})")
    for z in (0.0, 1.0, 1.5, 2.0, 3.0):
        sel = [r for r in rows[1:] if r["held_z"] > z]
        if sel:
            s = sum(r["val_drop"] for r in sel)
            se = math.sqrt(sum(r["val_drop_se"] ** 2 for r in sel))
            print(f"moves with held z > {z}: {len(sel):2d}, their val drops sum {s:+.6f} (± {se:.6f} if independent)")
    if a.json:
        a.json.write_text(json.dumps({"size": a.size, "seed": a.seed, "run": str(a.run), "rows": rows}, indent=1))


if __name__ == "__main__":
    main()
