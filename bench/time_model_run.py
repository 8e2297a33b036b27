"""``bench/time_model.py run``: the dry run's time plan, then the run itself with its stages timed.

The run is `voodoo train`'s Trainer (prepare + the method's run) in this process, with timers
around the functions that make each stage of memory/timing.py (a timer inside another's call is
taken out of the outer one): the model's load (``load_models``) and the weights' hash
(``provenance.run_record``), the Hessians (``ensure_compensation``), the candidates
(``setup.build_all``), the sensitivity pass (``ensure_table``), the student build
(``build_student``), the training steps (``Trainer._step``) and what is left. Printed per stage:
predicted, measured, predicted ÷ measured.

`--truncate N` first writes a copy of `--model` with its first N decoder layers (the embedding,
norm and head kept: the widths and vocabulary of the real model, real weights) into `--work`.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import time
from pathlib import Path

from voodoo_quant.cli.tp import parse_train_flags
from voodoo_quant.memory.dry_run import dry_run

STAGES = {  # (module, attribute) -> the time plan's stage
    ("voodoo_quant.training.trainer", "load_models"): "load and hash the weights",
    ("voodoo_quant.training.provenance", "run_record"): "load and hash the weights",
    ("voodoo_quant.training.trainer", "ensure_compensation"): "Hessians (error compensation)",
    ("voodoo_quant.training.setup", "build_all"): "candidates",
    ("voodoo_quant.training.trainer", "ensure_table"): "sensitivity pass",
    ("voodoo_quant.training.trainer", "build_student"): "student build",
    ("voodoo_quant.training.trainer.Trainer", "_step"): "training steps",
}


def truncate(model: Path, layers: int, out: Path) -> Path:
    """A copy of HF checkpoint `model` with its first `layers` decoder layers."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    out.mkdir(parents=True, exist_ok=True)
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            shutil.copy(f, out / f.name)
    cfg = json.loads((model / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    if cfg.get("layer_types"):
        cfg["layer_types"] = cfg["layer_types"][:layers]
    (out / "config.json").write_text(json.dumps(cfg, indent=1))
    keep = {}
    for f in sorted(model.glob("*.safetensors")):
        with safe_open(f, "pt") as st:
            for k in st.keys():
                parts = k.split(".")
                if "layers" in parts and int(parts[parts.index("layers") + 1]) >= layers:
                    continue
                keep[k] = st.get_tensor(k)
    save_file(keep, str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


class Timers:
    """Wall seconds per stage, a nested timed call taken out of the one around it."""

    def __init__(self):
        self.seconds: dict[str, float] = {}
        self._stack: list[list[float]] = []

    def wrap(self, fn, stage: str):
        def timed(*a, **k):
            self._stack.append([time.perf_counter(), 0.0])
            try:
                return fn(*a, **k)
            finally:
                t0, inner = self._stack.pop()
                dt = time.perf_counter() - t0
                self.seconds[stage] = self.seconds.get(stage, 0.0) + dt - inner
                if self._stack:
                    self._stack[-1][1] += dt
        return timed

    @contextlib.contextmanager
    def installed(self):
        import importlib

        saved = []
        for (mod, attr), stage in STAGES.items():
            path, _, cls = mod.rpartition(".") if mod.endswith("Trainer") else (mod, "", "")
            owner = getattr(importlib.import_module(path), cls) if cls else importlib.import_module(mod)
            saved.append((owner, attr, getattr(owner, attr)))
            setattr(owner, attr, self.wrap(getattr(owner, attr), stage))
        try:
            yield self
        finally:
            for owner, attr, fn in saved:
                setattr(owner, attr, fn)


def run(args) -> int:
    from voodoo_quant.training.trainer import Trainer

    flags = [f for f in args.flags if f != "--"]
    if args.truncate:
        i = flags.index("--model")
        flags[i + 1] = str(truncate(Path(flags[i + 1]), args.truncate, Path(args.work) / f"layers{args.truncate}"))
    cfg = parse_train_flags(flags)
    t0 = time.perf_counter()
    plan = dry_run(cfg, timing=True).time
    print(f"dry run with its probe: {time.perf_counter() - t0:.1f} s")
    for line in plan.lines():
        print(line)
    timers = Timers()
    t0 = time.perf_counter()
    with timers.installed():
        trainer = Trainer(cfg)
        trainer.prepare(build=cfg.method == "gates")
        trainer.train()
    total = time.perf_counter() - t0
    measured = dict(timers.seconds)
    measured["other (bake, guarantee, outputs)"] = total - sum(measured.values())
    print(f"{'stage':<36} {'predicted s':>11} {'measured s':>10} {'pred/meas':>9}")
    names = list(dict.fromkeys([s.name for s in plan.stages] + list(measured)))
    for name in names:
        p, m = plan.seconds(name), measured.get(name, 0.0)
        print(f"{name:<36} {p:11.1f} {m:10.1f} {p / m if m > 0 else float('nan'):9.2f}")
    print(f"{'TOTAL':<36} {plan.total:11.1f} {total:10.1f} {plan.total / total:9.2f}")
    if args.out:
        from voodoo_quant.core import fileio

        fileio.write_json(args.out, {"flags": flags, "predicted": {s.name: s.seconds for s in plan.stages},
                                     "measured": measured, "total": total,
                                     "rates": {k: v for k, v in vars(plan.rates).items()}})
    return 0
