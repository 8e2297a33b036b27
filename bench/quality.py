"""Quality benchmark: Voodoo files against stock llama.cpp recipes, resumable across sessions.

    .venv/bin/python bench/quality.py run --max_minutes 150        # the benchmark model (make bench-models)
    .venv/bin/python bench/quality.py report                       # docs/results/<name>.md + .png

``run`` drives the product's ladder (``voodoo_quant.tools.quantize``: its steps, with a
``Variant`` per method) on one model and evaluates every file with stock ``llama-perplexity
--kl-divergence`` (``voodoo_quant.tools.evaluate``) against the F32 reference on two held-out
texts (``quality_texts.py``: the plays and Python's own sources, split by file; calibration on
both, or one with ``--calib``). Every (file, eval text) becomes one JSON line appended to the
results file as soon as it is measured, with the digest of the settings that made it
(``quality_rows.py``); a rerun skips every row present with the same digest. The work folder
(the shared steps: tokens, F32 reference, imatrix, Hessians, eval bases) lives in the cache
folder, beside the candidate cache, so a later run on the same machine, from any checkout,
resumes where it stopped; on a new machine it rebuilds them. ``--max_minutes`` stops it between
files. A file is deleted once measured.

Work order (``quality_plan.py``, with the settings): the Q8_0 floor; per size, ascending, the written file (gates + selection, the
defaults) and the stock recipe of its badge; the other stock recipes; the compensated and the
plain Fisher knapsack (``--method sensitivity``, ``--error_compensation gptq`` / ``none``) per
size (and, when ``--methods`` names it, ``knapsack-gptq-packed``: compensated with
``--compensation_sweep packed``), in the order ``--methods`` gives; the uniform files (``llama-quantize --pure``); at ``--fair_sizes`` the written file's other
seeds, then each knapsack of ``--methods`` at those seeds (``voodoo train --seed`` also picks the
sequences of its Fisher pass; in the order ``--methods`` gives; a knapsack at the default seed is
the file above, named and keyed with no seed), then the written file's other step counts.
``report`` renders the tables and the plot from the JSON lines alone (``quality_report.py``).

A peer: ``bench/autoround.py run`` (``make bench-peer``; ``make bench-peer-deps`` installs the
``peer`` extra) adds AutoRound's GGUF files, its optimized RTN at ``gguf:q4_k_m gguf:q3_k_m
gguf:q2_k_s`` by default and its tuned mode with ``--tuned FORMAT --iters N``, to the same results
file: made from the same float teacher and calibration text, scored by this driver's code (a
``Bench`` whose ``items``, ``setup``, ``make`` and ``facts`` are AutoRound's), listed by ``report``
as ``autoround-<format>``. Never while ``run`` writes the same results file.
"""

from __future__ import annotations

import argparse
import logging
import math
import os
import shlex
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import quality_report as report  # noqa: E402
import quality_rows as store  # noqa: E402
import quality_texts as texts_mod  # noqa: E402
from quality_plan import (BENCH_NAME, DEFAULT_METHODS, FLOOR, METHODS, SHARED_STEPS, SIZES, UNIFORM,  # noqa: E402,F401
                          BenchConfig, Item, plan)

from voodoo_quant.candidates import compensate  # noqa: E402
from voodoo_quant.candidates.compensate import DEFAULT_SWEEP  # noqa: E402
from voodoo_quant.core import fileio  # noqa: E402
from voodoo_quant.core.errors import VoodooError  # noqa: E402
from voodoo_quant.selection.menus import DEFAULT_CANDIDATES  # noqa: E402
from voodoo_quant.tools.manifest import digest  # noqa: E402

# The product's default menu when the rows of the results files began: a row made with it records
# an empty menu (--menu not given). Those rows stay the record of that menu, so an empty --menu
# keeps that digest only while the default is this list; under another default, the row records
# the default's types, and a file made with it is a new row.
SIX_TYPE_DEFAULT = ("Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")


def row_menu(menu: tuple[str, ...]) -> list[str]:
    """The menu a trained row's digest records: --menu as given; without one, the product's
    default, or [] where that is still the six-type default the rows without one were made with."""
    if menu or DEFAULT_CANDIDATES == SIX_TYPE_DEFAULT:
        return list(menu)
    return list(DEFAULT_CANDIDATES)


@dataclass
class RunSummary:
    added: int = 0  # rows appended
    present: int = 0  # rows skipped: already in the results file
    stopped: bool = False  # the time budget ran out
    left: list[str] = field(default_factory=list)  # items not done (stopped, failed)
    failed: list[str] = field(default_factory=list)
    steps_ran: list[str] = field(default_factory=list)  # ladder steps that ran


class Bench:
    shared_steps = SHARED_STEPS  # the ladder steps `setup` runs once per process

    def __init__(self, cfg: BenchConfig, command: str = "", *, clock: Callable[[], float] = time.monotonic,
                 log: Callable[[str], None] = lambda s: print(f"[bench] {s}", flush=True)):
        self.cfg, self.command, self.clock, self.log = cfg, command, clock, log
        self.session = uuid.uuid4().hex[:12]
        self.versions = {"voodoo_quant": store.code_commit(), "llama.cpp": store.llama_cpp_commit()}
        self.costs = store.cost_path(cfg.results)
        self.history = {}  # (item, step) → seconds, from earlier sessions' cost lines
        for c in store.read_rows(self.costs):
            if c.get("seconds") is not None:
                self.history[(c.get("item"), c["step"])] = c["seconds"]

    # -- the plan and what is left of it --------------------------------------------------------
    def quantize_config(self, sizes: tuple[int, ...]):
        from voodoo_quant.tools.quantize import QuantizeConfig

        c, t = self.cfg, self.texts
        return QuantizeConfig(
            model=str(c.model), texts=[str(t.calib)], eval_texts=[str(t.evals[d]) for d in texts_mod.DOMAINS],
            sizes=sizes, output_dir=c.work / f"ladder-{'+'.join(c.calib)}", model_name=c.name, seq_len=c.seq_len,
            degrid_seed=c.degrid_seed,
            calib_sequences=c.calib_sequences, max_steps=c.steps[0], candidate_types=c.menu or None, device=c.device,
            dtype=c.dtype, lazy=c.lazy, train_extra=dict(c.train_extra), eval=False, workers=c.threads)

    def resolve_sizes(self) -> tuple[int, ...]:
        from voodoo_quant.tools.preflight import reachable

        given = [s for s in self.cfg.sizes if s != "min"]
        if "min" not in self.cfg.sizes:
            return tuple(sorted(set(given)))
        q = self.quantize_config((max(given, default=100),))
        q8, lo, *_ = reachable(Path(q.model), q.menus, q.text_model_class)
        smallest = math.ceil(100 * lo / q8)
        below = [s for s in given if s < smallest]
        if below:
            self.log(f"sizes {below} are below the smallest the menus reach on this model (Voodoo{smallest}): left out")
        return tuple(sorted({smallest, *(s for s in given if s >= smallest)}))

    def row_config(self, item: Item, text: str) -> dict[str, Any]:
        """What a row is made from: its digest is the row's identity across sessions."""
        c, t = self.cfg, self.texts
        d = {"v": 1, "model": self.model_sha, "degrid_seed": c.degrid_seed, "llama.cpp": self.versions["llama.cpp"],
             "file": item.key(),
             "calib": {"domains": list(c.calib), "sha256": t.calib_sha256, "seq_len": c.seq_len,
                       "calib_sequences": c.calib_sequences},
             "eval": {"text": text, "sha256": t.eval_sha256[text], "ctx": c.ctx, "chunks": c.chunks}}
        if item.trained:
            d["train"] = {"menu": row_menu(c.menu), "device": c.device, "dtype": c.dtype,
                          **item.variant(c.train_extra).train}
            if d["train"].get("error_compensation") != "none":  # a file of another walk is another file
                d["train"].setdefault("compensation_sweep", DEFAULT_SWEEP)
                rev = compensate.revision(d["train"]["compensation_sweep"])
                if rev is not None:  # (rows of the walk before it had revisions keep their digests)
                    d["train"]["compensation_walk"] = rev
        return d

    def items(self, sizes: tuple[int, ...]) -> list:
        """What this driver makes (a peer's driver makes its own items)."""
        return plan(self.cfg, sizes)

    # -- running ----------------------------------------------------------------------------------
    def prepare(self) -> tuple[int, ...]:
        """The texts, the sizes and the model's hash: everything a row's digest needs."""
        from voodoo_quant.tools.preflight import source_sha

        c = self.cfg
        domains = {"plays": texts_mod.domain("plays", c.plays_dir), "python": texts_mod.domain("python", c.python_dir)}
        self.texts = texts_mod.build_texts(domains, c.calib, c.work / "texts", eval_fraction=c.eval_fraction,
                                           seed=c.split_seed, calib_chars=c.calib_chars, eval_chars=c.eval_chars)
        sizes = self.resolve_sizes()
        self.model_sha = source_sha(c.model, self.quantize_config(sizes).output_dir / "work")
        return sizes

    def run(self) -> RunSummary:
        c = self.cfg
        t0 = self.clock()
        sizes = self.prepare()
        have = {r.get("digest") for r in store.read_rows(c.results)}
        todo, out = [], RunSummary()
        for item in self.items(sizes):
            missing = [x for x in texts_mod.DOMAINS if digest(self.row_config(item, x)) not in have]
            out.present += len(texts_mod.DOMAINS) - len(missing)
            if missing:
                todo.append((item, missing))
        self.log(f"{c.results}: {out.present} rows present, {len(todo)} files to make and measure")
        if not todo:
            return out
        from voodoo_quant.tools.quantize import open_ladder

        # The preflight checks room for one file (the largest due): each is deleted once measured.
        largest = max((i.size for i, _ in todo if i.trained), default=sizes[0])
        self.bases: dict[str, tuple[Path, float]] = {}
        self.ready: set[str] = set()
        with open_ladder(self.quantize_config((largest,))) as ladder:
            for n, (item, missing) in enumerate(todo):
                need = self.estimate(item, missing)
                if c.max_minutes is not None and self.clock() - t0 + need > 60 * c.max_minutes:
                    out.stopped = True
                    out.left += [i.label for i, _ in todo[n:]]
                    self.log(f"--max_minutes {c.max_minutes:g} spent (next: {item.label}, ~{need / 60:.0f} min): stopping")
                    break
                self.log(f"{item.label}: making ({', '.join(missing)} to measure)")
                before = dict(ladder.seconds)
                self.setup(ladder, item, missing)  # a failure here would fail every file: it stops the run
                try:
                    out.added += self.do(ladder, item, missing, before)
                except VoodooError as e:
                    self.log(f"{item.label} failed: {e}")
                    store.append_rows(self.costs, [self.cost_line(item, "failed", None, error=str(e))])
                    out.failed.append(item.label)
                    out.left.append(item.label)
            out.steps_ran = list(ladder.ran)
        return out

    def estimate(self, item: Item, texts: list[str]) -> float:
        """Seconds the item took in earlier sessions (its own steps, and the shared steps and eval
        bases not yet run in this one). An item never made is taken to cost what its kind did, the
        median over the items of its kind recorded (stock or uniform recipes; one method at other
        sizes); 0 where nothing of its kind was recorded either."""
        own = sum(s for (i, _), s in self.history.items() if i == item.label)
        if not own:
            totals: dict[str, float] = {}
            for (i, _), s in self.history.items():
                if i is not None and _kind(i) == _kind(item.label):
                    totals[i] = totals.get(i, 0.0) + s
            own = statistics.median(totals.values()) if totals else 0.0
        shared = 0.0 if "shared" in self.ready else sum(
            self.history.get((None, s), 0.0) for s in self.shared_steps if not self.found(s))
        bases = sum(self.history.get((None, f"eval-base-{x}"), 0.0) for x in texts
                    if x not in self.bases and not any((self.cfg.work / "eval").glob(f"base-{x}-*.kld")))
        return own + shared + bases

    def found(self, step: str) -> bool:
        """Whether this machine holds a finished `step` of the ladder with its outputs intact (of
        any inputs: an estimate, not the check the ladder makes before skipping it)."""
        from voodoo_quant.tools.manifest import Manifests

        work = self.quantize_config((100,)).output_dir / "work"
        r = Manifests(work).load(step)
        return r is not None and r.complete and bool(r.outputs) and all(Path(p).exists() for p in r.outputs)

    def setup(self, ladder, item: Item, texts: list[str]) -> None:
        """The shared steps (once per process) and the eval bases the item needs."""
        if "shared" not in self.ready:
            ladder.data()
            ladder.teacher()
            ladder.reference_gguf()
            ladder.imatrix_step()
            self.ready.add("shared")
        if item.trained and "cache" not in self.ready:
            ladder.cache()
            self.ready.add("cache")
        for text in texts:
            self.base(ladder, text)

    def make(self, ladder, item: Item) -> tuple[Path, list[Path], dict[str, float]]:
        """The item's file, what to delete with it, and the seconds of the steps that made it
        outside the ladder (none here: the ladder's own steps make it)."""
        if not item.trained:
            f = ladder.stock(item.recipe, pure=item.method == "uniform")
            return f, [f], {}
        v = item.variant(self.cfg.train_extra)
        ladder.train(item.size, v)
        f = ladder.export(item.size, v)
        return f, [f, f.with_name(f.stem + ".tensor-types.txt")], {}

    def base(self, ladder, text: str) -> tuple[Path, float]:
        """The reference's log-probs on an eval text: once per machine (kept under work/eval)."""
        from voodoo_quant.core import fileio
        from voodoo_quant.tools.evaluate import kld_base

        if text not in self.bases:
            key = digest({"reference": ladder.keys["reference"], "text": self.texts.eval_sha256[text],
                          "ctx": self.cfg.ctx, "chunks": self.cfg.chunks})
            base = self.cfg.work / "eval" / f"base-{text}-{key}.kld"
            info = base.with_suffix(".json")
            if not (base.is_file() and info.is_file()):
                t = self.clock()
                ppl = kld_base(ladder.reference, self.texts.evals[text], base, self.ppl_args(ladder))
                fileio.write_json(info, {"reference_ppl": ppl})
                store.append_rows(self.costs, [self.cost_line(None, f"eval-base-{text}", self.clock() - t)])
            self.bases[text] = (base, fileio.read_json(info, what="eval base record")["reference_ppl"])
        return self.bases[text]

    def ppl_args(self, ladder) -> list[str]:
        from voodoo_quant.tools.evaluate import perplexity_args

        return perplexity_args(self.cfg.ctx, self.cfg.chunks, ladder.pre.workers)

    def do(self, ladder, item: Item, texts: list[str], before: dict[str, float]) -> int:
        """Make the item's file and append one row per missing eval text; returns the rows added.
        `before`: the ladder's step times before the item's setup (what ran since is its cost)."""
        from voodoo_quant.tools.evaluate import kld_file

        f, made, own = self.make(ladder, item)
        steps = {**{k: v for k, v in ladder.seconds.items() if before.get(k) != v}, **own}
        store.append_rows(self.costs, [self.cost_line(None if k in SHARED_STEPS else item, k, s) for k, s in steps.items()])
        facts = self.facts(ladder, item)
        rows = []
        for text in texts:
            base, ref_ppl = self.bases[text]
            t = self.clock()
            row, chunks = kld_file(f, base, self.ppl_args(ladder))
            dt = self.clock() - t
            store.append_rows(self.costs, [self.cost_line(item, f"eval-{text}", dt)])
            conf = self.row_config(item, text)
            r = {"digest": digest(conf), "model": self.cfg.name, "calib": "+".join(self.cfg.calib), "text": text,
                 **item.key(), **{k: v for k, v in asdict(row).items() if k != "tokens"}, "reference_ppl": ref_ppl,
                 "kld_chunks": [round(x, 7) for x in chunks], "n_chunks": len(chunks), **facts,
                 "make_seconds": {k: s for k, s in steps.items() if k not in SHARED_STEPS}, "eval_seconds": round(dt, 1),
                 "peak_rss_mb": store.peak_rss_mb(), "threads": ladder.pre.workers, "cpus": os.cpu_count(),
                 "versions": self.versions, "session": self.session, "date": _now(), "command": self.command,
                 "config": conf}
            store.append_rows(self.cfg.results, [r])
            rows.append(r)
            self.log(f"{f.name} on {text}: KLD {r['kld_mean']:.6f} ± {r['kld_stderr'] or float('nan'):.6f}, "
                     f"{r['size_bytes'] / 1e6:.1f} MB")
        if not self.cfg.keep_files:
            for p in made:
                p.unlink(missing_ok=True)
        return len(rows)

    def facts(self, ladder, item: Item) -> dict[str, Any]:
        """What made a trained file: the selection's winner and the error compensation."""
        if not item.trained:
            return {}
        d = fileio.read_json(ladder.work / "runs" / ladder.run_name(item.size, item.variant(self.cfg.train_extra))
                             / "assignment.json", what="run assignment")
        g = d.get("meta", {}).get("guarantee")
        comp = d.get("compensation")
        return {"made_by": g["winner"] if g else d.get("meta", {}).get("method", "gates"),
                "compensation": comp.get("method") if isinstance(comp, dict) else comp}

    def cost_line(self, item: Item | None, step: str, seconds: float | None, **extra) -> dict[str, Any]:
        return {"step": step, "item": item.label if item else None, "seconds": None if seconds is None else round(seconds, 1),
                "peak_rss_mb": store.peak_rss_mb(), "model": self.cfg.name, "calib": "+".join(self.cfg.calib),
                "cpus": os.cpu_count(), "session": self.session, "date": _now(), "versions": self.versions, **extra}


def _kind(label: str) -> str:
    """An item label's kind: ``stock``/``uniform`` for a recipe (``stock-IQ3_S``), the method for a
    trained file (``Voodoo30-knapsack-gptq`` → ``knapsack-gptq``)."""
    return label.split("-", 1)[1] if label.startswith("Voodoo") else label.split("-", 1)[0]


def _now() -> str:
    return datetime.now(timezone.utc).isoformat(timespec="seconds")


# -- the command line ----------------------------------------------------------------------------

def _list(v: list[str]) -> list[str]:
    return [p for item in v for p in item.replace(",", " ").split() if p]


def parse(argv: list[str]) -> tuple[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="make and measure what the results file lacks")
    d = BenchConfig.__dataclass_fields__
    r.add_argument("--model", type=Path, help="HF dir or GGUF (default: the de-gridded benchmark teacher)")
    r.add_argument("--name", help=f"results name (default {BENCH_NAME} for the benchmark model, else the model's)")
    r.add_argument("--results", type=Path, help="the JSONL (default docs/results/<name>.jsonl)")
    r.add_argument("--work", type=Path, help="work folder (default <VOODOO_CACHE_DIR>/bench/<name>)")
    lists = {"sizes": ("percent of uniform Q8_0; min: the smallest reachable", str),
             "methods": (f"of {' '.join(METHODS)}", str), "stock": ("llama-quantize ftypes (Q8_0 always)", str),
             "uniform": ("llama-quantize --pure ftypes", str), "steps": ("gate steps: the first everywhere", int),
             "seeds": ("seeds: the first everywhere, the others at --fair_sizes (the knapsacks' too)", int),
             "fair_sizes": ("sizes of the other steps and seeds", int),
             "calib": ("calibration domains: plays python", str), "menu": ("--candidate_types (default: the product's)", str)}
    for k, (h, typ) in lists.items():
        default = d[k].default
        r.add_argument(f"--{k}", nargs="+", default=None, help=f"{h} (default {' '.join(map(str, default)) or 'none'})")
    for k, typ in (("degrid_seed", int), ("plays_dir", Path), ("python_dir", Path), ("eval_fraction", float),
                   ("split_seed", int),
                   ("calib_chars", int), ("eval_chars", int), ("seq_len", int), ("calib_sequences", int), ("ctx", int),
                   ("chunks", int), ("device", str), ("dtype", str), ("threads", int), ("max_minutes", float)):
        r.add_argument(f"--{k}", type=typ, default=None, help=f"default {d[k].default}")
    r.add_argument("--lazy", action="store_true", help="voodoo train --lazy")
    r.add_argument("--keep_files", action="store_true", help="keep each GGUF after measuring it")
    r.add_argument("--train_args", default=None, help="more voodoo train flags of every trained file, one string")
    r.add_argument("--no_report", action="store_true", help="do not render the report after the run")
    p = sub.add_parser("report", help="render docs/results/<name>.md and .png from the JSONL")
    p.add_argument("--results", type=Path, default=ROOT / "docs" / "results" / f"{BENCH_NAME}.jsonl")
    p.add_argument("--out", type=Path, default=None, help="Markdown (default: <results>.md; the plot beside it)")
    a = ap.parse_args(argv)
    if a.command == "report":
        return "report", a
    kw: dict[str, Any] = {}
    for k, (_, typ) in lists.items():
        if getattr(a, k) is not None:
            vals = _list(getattr(a, k))
            kw[k] = tuple(v if (k == "sizes" and v == "min") else typ(v) for v in vals)
    for k in ("model", "degrid_seed", "name", "results", "work", "plays_dir", "python_dir", "eval_fraction", "split_seed",
              "calib_chars", "eval_chars", "seq_len", "calib_sequences", "ctx", "chunks", "device", "dtype", "threads",
              "max_minutes"):
        if getattr(a, k) is not None:
            kw[k] = getattr(a, k)
    if a.train_args:
        from voodoo_quant.cli.quantize import train_extra

        kw["train_extra"] = train_extra(shlex.split(a.train_args))
    return "run", (BenchConfig(lazy=a.lazy, keep_files=a.keep_files, **kw), a.no_report)


def render(results: Path, out: Path | None = None) -> Path:
    rows, costs = store.read_rows(results), store.read_rows(store.cost_path(results))
    if not rows:
        raise SystemExit(f"{results}: no rows to report")
    md = Path(out or results.with_suffix(".md"))
    return report.write(rows, costs, md, md.with_suffix(".png"))


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what, a = parse(argv)
    if what == "report":
        print(render(a.results, a.out))
        return 0
    cfg, no_report = a
    # What the `voodoo` CLI sets for its own process before its first large tensor (huge pages for
    # torch's CPU tensors: a training step's fresh mixtures fault in 2 MB, not 4 KB, at a time). This
    # driver calls the library, not the CLI, so it sets them itself; the user's values win.
    from voodoo_quant.hardware.envdefaults import apply_env_defaults, host_env_defaults

    apply_env_defaults(host_env_defaults(), os.environ)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    command = shlex.join([".venv/bin/python", os.path.relpath(Path(__file__).resolve(), ROOT), *argv])
    s = Bench(cfg, command).run()
    print(f"[bench] added {s.added} rows ({s.present} present); "
          + (f"stopped by --max_minutes with {len(s.left)} files left" if s.stopped else "done")
          + (f"; failed: {', '.join(s.failed)}" if s.failed else ""), flush=True)
    if s.added and not no_report:
        print(f"[bench] report: {render(cfg.results)}")
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main())
