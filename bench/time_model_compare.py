"""``bench/time_model.py compare``: a cost file's step times against the time model's prediction.

The config is the train step's (`voodoo train` flags after ``--``); the ladder's other steps take
the benchmark's settings (``--calib_sequences``, ``--threads``). Printed per cost line: the step,
its item, measured and predicted seconds and predicted ÷ measured; then the sum over the steps
predicted. The rates are probed once, now.
"""

from __future__ import annotations

import dataclasses
import json
import re
import subprocess
from pathlib import Path

from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.core import envs
from voodoo_quant.gguf import recipe_inputs
from voodoo_quant.memory import timing as tm
from voodoo_quant.memory.dry_run import dry_run
from voodoo_quant.memory.rates import probe
from voodoo_quant.memory.time_plan import convert_seconds, imatrix_seconds, plan_time, stock_seconds
from voodoo_quant.training.guarantee import uniform_types


def _recipe(step: str) -> tuple[str, bool] | None:
    for prefix, pure in (("stock-", False), ("pure-", True)):
        if step.startswith(prefix):
            return step[len(prefix):], pure
    return None


def compare(args) -> int:
    flags = [f for f in args.flags if f != "--"]
    calib = 64
    if "--calib_sequences" in flags:  # the ladder's, not a train flag
        i = flags.index("--calib_sequences")
        calib = int(flags[i + 1])
        del flags[i:i + 2]
    cfg = parse_train_flags(flags)
    run = dry_run(cfg)
    from voodoo_quant.model.lazyload import text_skeleton

    model = text_skeleton(cfg.model, cfg.text_model_class)
    plans, budget = run.plans, run.budget
    rows = [json.loads(x) for x in args.costs.read_text().splitlines() if x.strip()]
    if args.session:
        rows = [r for r in rows if r.get("session") in args.session]
    rows = [r for r in rows if r.get("seconds") is not None]
    recipes = {_recipe(r["step"]) for r in rows} - {None}
    stock = {}
    for name, pure in recipes:
        if pure:
            stock[(name, pure)] = {p.name: uniform_types(p, _pure_type(name), True) for p in plans}
        else:
            stock[(name, pure)] = dict(recipe_inputs.stock_types(plans, model.config, name, has_imatrix=True))
    types = {t for p in plans for t in p.menu.types} | {t for m in stock.values() for t in m.values() if t}
    text = model.config.get_text_config()
    rates = probe(types, hidden=text.hidden_size, intermediate=text.intermediate_size, compensation=cfg.compensation,
                  sweep=cfg.compensation_sweep, damp=cfg.compensation_damp, workers=envs.quant_workers(),
                  rungs=max(len(p.menu.types) for p in plans))
    ckpt = sum(f.stat().st_size for f in Path(cfg.model).glob("*.safetensors")) or None
    shp = tm.model_shapes(model, plans, cfg.seq_len)
    everything = {(p.name, t) for p in plans for t in p.menu.types}
    if cfg.imatrix and Path(cfg.imatrix).is_file():
        from voodoo_quant.gguf import imatrix as im

        covered = set(im.load(cfg.imatrix).entries)
    else:  # as `voodoo imatrix` writes it: no vector for the embedding or the output head
        covered = {p.gguf_name for p in plans} - {"token_embd.weight", "output.weight"}
    print(f"probe: {rates.seconds:.1f} s, GEMM {rates.gemm / 1e9:.1f} GFLOP/s on {rates.threads} thread(s), "
          f"quantization workers {rates.workers} at {rates.parallel:.2f}× one")
    by_size: dict[int, tuple] = {}

    def plans_at(size: int | None):
        """(fresh, later) time plans of the run at Voodoo`size` (None: the flags' own target)."""
        if size not in by_size:
            c = cfg if size is None else dataclasses.replace(cfg, compression_ratio=size / 100, target_bits=None,
                                                             target_size=None)
            b = budget if size is None else dry_run(c).budget
            by_size[size] = (plan_time(c, model, plans, b, rates, covered=covered, checkpoint_bytes=ckpt),
                             plan_time(c, model, plans, b, rates, covered=covered, cached=everything,
                                       stored=("hessians", "table"), checkpoint_bytes=ckpt))
        return by_size[size]

    for line in plans_at(None)[0].lines()[1:]:
        print("  from scratch:", line.strip())
    seen_train: set[tuple[str, str]] = set()
    total_m = total_p = 0.0
    print(f"{'step':<34} {'item':<30} {'measured s':>10} {'predicted s':>11} {'pred/meas':>9}")
    for r in rows:
        step, item, meas = r["step"], r.get("item") or "", float(r["seconds"])
        pred = None
        if step == "reference":
            pred = convert_seconds(shp)
        elif step == "imatrix":
            pred = imatrix_seconds(shp, rates, calib * cfg.seq_len, ckpt or shp.param_bytes)
        elif step.startswith("train-"):
            kind = (r.get("session"), step.split("-", 2)[-1])
            fresh, later = plans_at(_size(step))
            pred = (later if kind in seen_train else fresh).total
            seen_train.add(kind)
        elif step.startswith("export-"):
            pred = plans_at(_size(step))[0].seconds("export (voodoo export)")
            if _reads_reference(r):  # the ladder's export reads its F32 reference: no conversion
                pred -= convert_seconds(shp)
        elif _recipe(step):
            pred = stock_seconds(plans, stock[_recipe(step)], rates, rates.workers, shp.param_bytes, covered)
        ratio = f"{pred / meas:9.2f}" if pred is not None and meas > 0 else f"{'-':>9}"
        print(f"{step:<34} {item[:30]:<30} {meas:10.1f} {pred if pred is not None else float('nan'):11.1f} {ratio}")
        if pred is not None:
            total_m += meas
            total_p += pred
    if total_m:
        print(f"{'steps predicted, together':<65} {total_m:10.1f} {total_p:11.1f} {total_p / total_m:9.2f}")
    return 0


def _reads_reference(row: dict) -> bool:
    """Whether the row's code passes the ladder's F32 reference to export (``--converted``, commit
    06ccfc3 and after) instead of converting again."""
    commit = str(row.get("versions", {}).get("voodoo_quant", "")).split("-")[0]
    if not commit:
        return True
    p = subprocess.run(["git", "merge-base", "--is-ancestor", "06ccfc3", commit], cwd=Path(__file__).parent,
                       capture_output=True)
    return p.returncode == 0


def _size(step: str) -> int | None:
    """30 of ``train-Voodoo30-knapsack``."""
    m = re.match(r"\w+-Voodoo(\d+)", step)
    return int(m.group(1)) if m else None


def _pure_type(recipe: str) -> str:
    """The main type of a llama-quantize ftype (Q4_K_S -> Q4_K)."""
    from voodoo_quant.core import qtypes as qt

    for cut in (recipe, recipe.rsplit("_", 1)[0]):
        try:
            return qt.get(cut).name
        except Exception:  # noqa: BLE001 - not a type name: cut further
            continue
    raise ValueError(f"no main type for {recipe}")
