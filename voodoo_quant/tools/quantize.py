"""`voodoo quantize`: a model and some text → a publishable ladder of GGUFs with its model card.

    data → make-teacher → reference GGUF → imatrix → candidate cache → train (per size) →
    export (per size) → stock llama-quantize recipes → eval (stock llama-perplexity) → card

One :class:`QuantizeConfig` (``quantize_config.py``) is shared by the CLI (``cli/quantize.py``) and the Python API
(``voodoo_quant.api.quantize``). Every step records what it was made from
(``tools/manifest.py``) and is skipped when its outputs exist and were made from the same inputs,
so an interrupted ladder resumes where it stopped and a changed input reruns only what depends
on it. Bad input is refused before any long work (``tools/preflight.py``).

Work shared across sizes: one imatrix, one candidate cache (content-keyed, ``cache.py``), one
sensitivity table (it depends on the model, menus and calibration tokens, not on the size: the
first size computes it, the others reuse it; the trainer checks its key), and the teacher's
forward: its final hidden states per training batch are cached on disk and reused by every
further size (exact: ``training/teacher_cache.py``).

Layout of ``output_dir``: the published files at the top (``<Model>.Voodoo<NN>_<BADGE>.gguf``
with its ``.tensor-types.txt``, ``imatrix.gguf``, ``eval.json``, ``pareto.png``, ``README.md``),
everything else under ``work/`` (tokens, teacher, reference F32 GGUF, runs, stock files, records).
"""

from __future__ import annotations

import logging
import shutil
from contextlib import contextmanager
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, Callable, Iterator

from ..core import fileio
from ..core.settings import OUTPUT, key_dict
from ..gguf.converter import convert
from ..selection.menus import MenuConfig
from ..training.config import TrainConfig
from .data import META_NAME, TRAIN_NAME, DataConfig, make_data
from .data import EVAL_NAME as E
from .ladder_display import LadderDisplay
from .manifest import Clock, Manifests, digest
from .quantize_config import FLOOR, QuantizeConfig, default_model_name  # noqa: F401  (the API's names)
from .variant import Variant

_DEFAULT_SWEEP = TrainConfig.__dataclass_fields__["compensation_sweep"].default


def _walk(tcfg: TrainConfig) -> str | None:
    """The revision of the compensation walk a run's candidates come from (compensate.revision)."""
    from ..candidates.compensate import revision  # lazy: voodoo_quant.api imports this module

    return None if tcfg.compensation == "none" else revision(tcfg.compensation_sweep)


log = logging.getLogger(__name__)

IMATRIX_NAME = "imatrix.gguf"
# Train settings that are paths: a ladder step keys them by what they hold (teacher, data, imatrix)
# or by where the ladder puts them (the run folder), not by their names.
_KEYED_BY_CONTENT = ("model", "data_dir", "imatrix", "output_dir")
@dataclass
class QuantizeResult:
    files: dict[int, Path]  # size → GGUF
    eval: dict[str, Any] | None
    card: Path
    ran: list[str]  # steps that ran
    skipped: list[str]  # steps skipped (same inputs)
    seconds: dict[str, float]  # per step that ran now


class Ladder:
    def __init__(self, cfg: QuantizeConfig, display: LadderDisplay, pre):
        self.cfg, self.ui, self.pre = cfg, display, pre
        out = cfg.output_dir
        self.work = out / "work"
        self.m = Manifests(self.work)
        self.keys: dict[str, str] = {}
        self.ran: list[str] = []
        self.skipped: list[str] = []
        self.seconds: dict[str, float] = {}
        self.notes: dict[str, str] = {}
        self.data_dir = self.work / "data"
        src = Path(cfg.model)
        self.make_hf = src.suffix.lower() == ".gguf" or cfg.degrid_seed is not None
        self.teacher_hf = self.work / "hf" / cfg.model_name if self.make_hf else src
        self.reference = self.work / "gguf" / f"{cfg.model_name}.F32.gguf"
        self.imatrix = out / IMATRIX_NAME

    # -- the step runner ---------------------------------------------------------------------
    def step(self, name: str, inputs: dict[str, Any], outputs: Callable[[], list[Path]], body: Callable[[], Any],
             *, total: int | None = None, on_stale: Callable[[], None] | None = None) -> str:
        key = digest(inputs)
        self.keys[name] = key
        if self.m.done(name, key):
            self.skipped.append(name)
            self.ui.end(name, "skipped (made from the same inputs)")
            return key
        if on_stale is not None and self.m.started_with_other_inputs(name, key):
            on_stale()
        self.m.start(name, key, inputs)
        self.ui.begin(name, total)
        clock = Clock()
        body()
        dt = clock()
        self.m.finish(name, key, inputs, outputs(), dt)
        self.ran.append(name)
        self.seconds[name] = round(dt, 1)
        self.ui.end(name, f"{dt:.0f} s" + (f" ({self.notes[name]})" if name in self.notes else ""))
        return key

    # -- steps ---------------------------------------------------------------------------------
    def data(self) -> None:
        c = self.cfg
        d = self.data_dir
        inputs = {"source": self.pre.source_sha, "texts": self.pre.text_hashes, "eval_texts": self.pre.eval_hashes,
                  "seq_len": c.seq_len, "eval_fraction": c.eval_fraction, "glob": c.glob, "seed": c.seed, "v": 1}
        self.step("data", inputs, lambda: [d / TRAIN_NAME, d / E, d / META_NAME], lambda: make_data(DataConfig(
            model=c.model, inputs=c.texts, output_dir=d, seq_len=c.seq_len, eval_fraction=c.eval_fraction,
            eval_files=c.eval_texts, glob=c.glob, seed=c.seed, progress=False)))

    def teacher(self) -> None:
        from .teacher import MakeTeacherConfig, make_teacher  # lazy: voodoo_quant.api imports this module

        c = self.cfg
        if not self.make_hf:  # an HF dir is its own float teacher: nothing to make
            self.keys["make-teacher"] = digest({"source": self.pre.source_sha})
            self.skipped.append("make-teacher")
            self.ui.end("make-teacher", f"the HF dir {self.teacher_hf} is the float teacher")
            return

        def body() -> None:
            if self.teacher_hf.exists():  # from other inputs (or a killed run): made again
                shutil.rmtree(self.teacher_hf)
            make_teacher(MakeTeacherConfig(model=c.model, output_dir=self.work / "teacher", dtype="float32",
                                           degrid_seed=c.degrid_seed, hf_out=self.teacher_hf,
                                           text_model_class=c.text_model_class, progress=False))

        # the de-grid block follows the source's types (make_teacher.degrid_block_for): v2
        inputs = {"source": self.pre.source_sha, "degrid_seed": c.degrid_seed, "text_model_class": c.text_model_class, "v": 2}
        self.step("make-teacher", inputs, lambda: [self.teacher_hf / "config.json"], body)

    def reference_gguf(self) -> None:
        ref = self.reference
        self.step("reference", {"teacher": self.keys["make-teacher"], "outtype": "f32"}, lambda: [ref],
                  lambda: fileio.write_with(ref, lambda tmp: convert(self.teacher_hf, tmp, outtype="f32")))

    def imatrix_step(self) -> None:
        from .calibrate import ImatrixConfig, compute  # lazy: voodoo_quant.api imports this module

        inputs = {"teacher": self.keys["make-teacher"], "data": self.keys["data"], "sequences": self.cfg.calib_sequences}
        self.step("imatrix", inputs, lambda: [self.imatrix], lambda: compute(ImatrixConfig(
            model=str(self.teacher_hf), tokens=str(self.data_dir / "train_tokens.pt"), output=str(self.imatrix),
            max_sequences=self.cfg.calib_sequences, batch_size=4)))

    def cache(self) -> None:
        from .precache import PrecacheConfig, precache  # lazy: voodoo_quant.api imports this module

        c = self.cfg
        if c.train_config(c.sizes[0], self.teacher_hf).compensation != "none":
            # compensated candidates need the Hessians the first size collects: it builds them
            log.info("candidate cache: built by the first size (--error_compensation needs its Hessians)")
            return
        menus: MenuConfig = c.menus
        marker = self.work / "candidates.json"
        inputs = {"teacher": self.keys["make-teacher"], "imatrix": self.keys["imatrix"],
                  "menus": [list(menus.candidate_types), menus.attention_candidates, menus.non_attention_candidates]}

        def body() -> None:
            rep = precache(PrecacheConfig(model=str(self.teacher_hf), candidate_types=menus.candidate_types,
                                          attention_candidates=menus.attention_candidates,
                                          non_attention_candidates=menus.non_attention_candidates,
                                          imatrix=str(self.imatrix)), progress=False)
            fileio.write_json(marker, {"candidates": len(getattr(rep, "paths", {}) or {})})

        self.step("candidate-cache", inputs, lambda: [marker], body)

    def run_name(self, size: int, variant: Variant | None = None) -> str:
        """``Voodoo<NN>``, or ``Voodoo<NN>-<variant>``: the run's folder and its steps' names."""
        return f"Voodoo{size}" + (f"-{variant.name}" if variant is not None else "")

    def train(self, size: int, variant: Variant | None = None) -> None:
        from ..candidates.hessian_store import FILE as HESSIANS_FILE  # lazy: voodoo_quant.api imports this module
        from ..training.sensitivity import TABLE_NAME  # lazy: voodoo_quant.api imports this module

        name = self.run_name(size, variant)
        run = self.work / "runs" / name
        tcfg = self.cfg.train_config(size, self.teacher_hf, self.data_dir, self.imatrix, run)
        if variant is not None:
            tcfg = variant.apply(tcfg)
        # what changes the trained file (settings.py); the paths are keyed by their contents above
        settings = {k: v for k, v in key_dict(tcfg, OUTPUT).items() if k not in _KEYED_BY_CONTENT}
        inputs = {"teacher": self.keys["make-teacher"], "data": self.keys["data"], "imatrix": self.keys["imatrix"],
                  "train": settings}
        walk = _walk(tcfg)
        if walk is not None:  # this version's walk makes other candidates (steps keyed before it keep their keys)
            inputs["walk"] = walk
        shared = self.shared_table(tcfg, variant is not None)

        def stale() -> None:  # the old run's journal and outputs were made from other inputs
            for f in ("partial.pt", "assignment.json", "tensor-types.txt", "train_log.jsonl", tcfg.output_name):
                (run / f).unlink(missing_ok=True)

        def body() -> None:
            # made once for the ladder; the trainer checks each key. The shared table replaces a
            # run's older one (left by another menu). The Hessians are linked: ~10 GB at 1.5B.
            own = run / TABLE_NAME
            if shared.is_file() and (not own.is_file() or own.stat().st_mtime_ns < shared.stat().st_mtime_ns):
                fileio.copy_file(shared, own)
            if (self.work / HESSIANS_FILE).is_file() and not (run / HESSIANS_FILE).is_file():
                fileio.link_or_copy(self.work / HESSIANS_FILE, run / HESSIANS_FILE)
            _, cache = run_training(tcfg, self.ui.advance,
                                    self._teacher_cache_dir() if self.cfg.share_teacher_forward else None)
            if cache is not None:
                self.notes[f"train-{name}"] = (f"teacher forward from the cache for {cache.hits} of "
                                               f"{cache.hits + cache.misses} batches")
            if (run / TABLE_NAME).is_file():  # also when this size extended its curvature to more rungs
                fileio.write_bytes(shared, (run / TABLE_NAME).read_bytes())
            if (run / HESSIANS_FILE).is_file() and not (self.work / HESSIANS_FILE).is_file():
                fileio.link_or_copy(run / HESSIANS_FILE, self.work / HESSIANS_FILE)

        self.step(f"train-{name}", inputs, lambda: [run / "assignment.json", run / "tensor-types.txt"], body,
                  total=tcfg.max_steps, on_stale=stale)

    def shared_table(self, tcfg: TrainConfig, variant: bool) -> Path:
        """The sensitivity table a ladder's sizes share: one per compensation walk, seed, menus and
        table settings, so runs alternating between them do not recompute each other's (the
        table's own key still decides whether a run uses it)."""
        from ..training.sensitivity import TABLE_NAME  # lazy: voodoo_quant.api imports this module

        comp = tcfg.compensation if tcfg.compensation == "none" or tcfg.compensation_sweep == _DEFAULT_SWEEP \
            else f"{tcfg.compensation}-{tcfg.compensation_sweep}"
        home = self.work if not variant else self.work / "variants" / f"{comp}-seed{tcfg.seed}"
        # not the fill: it changes only rows that are not a multiple of 256
        key = {"menus": asdict(replace(tcfg.menus, fill=False)), "kind": tcfg.sensitivity_kind,
               "sequences": tcfg.sensitivity_sequences}
        if _walk(tcfg) is not None:
            key["walk"] = _walk(tcfg)
        return home / f"{TABLE_NAME.removesuffix('.pt')}-{digest(key)[:12]}.pt"

    def _teacher_cache_dir(self) -> Path:
        key = digest({"teacher": self.keys["make-teacher"], "dtype": self.cfg.dtype, "device": self.cfg.device,
                      "extra": {k: self.cfg.train_extra.get(k) for k in ("teacher_quant", "teacher_checkpoint",
                                                                       "base_checkpoint", "teacher_device")}})
        return self.work / "teacher_hidden" / key

    def export(self, size: int, variant: Variant | None = None) -> Path:
        from .export import ExportConfig, export  # lazy: voodoo_quant.api imports this module

        name = self.run_name(size, variant)
        run = self.work / "runs" / name
        where = {"output_dir": self.cfg.output_dir} if variant is None else {
            "output_dir": self.work / "variants", "output_name": f"{self.cfg.model_name}.{name}.gguf"}
        if "reference" not in self.keys:  # the teacher's conversion: export reads it instead of converting again
            self.reference_gguf()
        ecfg = ExportConfig(model=self.teacher_hf, assignment=run / "assignment.json", imatrix=self.imatrix,
                            size_percent=size, model_name=self.cfg.model_name, overwrite=True,
                            converted=self.reference, **where)
        path = ecfg.output_dir / ecfg.file_name()
        ttf = path.with_name(path.stem + ".tensor-types.txt")
        inputs = {"train": self.keys[f"train-{name}"], "teacher": self.keys["make-teacher"],
                  "imatrix": self.keys["imatrix"], "name": path.name}
        self.step(f"export-{name}", inputs, lambda: [path, ttf], lambda: export(ecfg))
        return path

    def stock_file(self, recipe: str, pure: bool = False) -> Path:
        return self.work / "stock" / f"{self.cfg.model_name}.{'pure' if pure else 'stock'}-{recipe}.gguf"

    def stock(self, recipe: str, pure: bool = False) -> Path:
        """``llama-quantize --imatrix`` of the reference to `recipe`; `pure` (``--pure``): the
        recipe's main type on every tensor, a uniform file."""
        from .llama_tools import run_tool  # lazy: voodoo_quant.api imports this module

        f = self.stock_file(recipe, pure)
        threads = str(self.pre.workers)
        inputs = {"reference": self.keys["reference"], "imatrix": self.keys["imatrix"], "recipe": recipe}
        flags = ["--pure"] if pure else []
        self.step(f"{'pure' if pure else 'stock'}-{recipe}", {**inputs, **({"pure": True} if pure else {})}, lambda: [f],
                  lambda: fileio.write_with(f, lambda tmp: run_tool(
                      "llama-quantize", [*flags, "--imatrix", self.imatrix, self.reference, tmp, recipe, threads])))
        return f

    def evaluate(self, files: list[tuple[Path, str, int | None]]) -> dict[str, Any]:
        from .ladder_eval import evaluate_ladder  # lazy: voodoo_quant.api imports this module

        return evaluate_ladder(self, files)

    def check_memory(self) -> None:
        """Every size's memory plan (``--memory_check``), once the teacher's config exists and
        before the reference, the imatrix and the candidates: a size that cannot fit stops the
        ladder now, not at its training step. Each training step plans again and applies."""
        from .memory_check import check_memory  # lazy: voodoo_quant.api imports this module

        for size in self.cfg.sizes:
            check_memory(self.cfg.train_config(size, self.teacher_hf, self.data_dir, self.imatrix), announce=False)

    # -- everything ----------------------------------------------------------------------------
    def run(self) -> QuantizeResult:
        from .card import write_card  # lazy: voodoo_quant.api imports this module

        c = self.cfg
        self.data()
        self.teacher()
        self.check_memory()
        self.reference_gguf()
        self.imatrix_step()
        self.cache()
        ours: dict[int, Path] = {}
        for s in c.sizes:
            self.train(s)
            ours[s] = self.export(s)
        result = None
        if c.eval:
            files = [(ours[s], "voodoo", s) for s in c.sizes]
            files += [(self.stock(q), "stock", None) for q in c.stock]
            result = self.evaluate(files)
        self.ui.begin("model card")
        card = write_card(self, ours, result)
        self.ui.end("model card", str(card))
        return QuantizeResult(ours, result, card, self.ran, self.skipped, self.seconds)


def run_training(tcfg, on_step: Callable[[], None], teacher_cache: Path | None):
    """`voodoo train` through TrainConfig + Trainer, the teacher behind the hidden-state cache in
    `teacher_cache` (None: no cache). Returns (TrainResult, the cache or None)."""
    from ..training.teacher_cache import wrap_teacher  # lazy: voodoo_quant.api imports this module
    from ..training.trainer import Trainer  # lazy: voodoo_quant.api imports this module
    from .memory_check import check_memory  # lazy: voodoo_quant.api imports this module

    tcfg = check_memory(tcfg).cfg  # before the Hessians and candidates: what fits (--memory_check)
    trainer = Trainer(tcfg, on_step=lambda m: on_step(), progress=False)
    run = trainer.prepare()
    cache = None
    if teacher_cache is not None and run.tp is None:
        run.teacher, cache = wrap_teacher(run.teacher, teacher_cache)
    return trainer.train(), cache


def step_count(cfg: QuantizeConfig) -> int:
    n = 5 + 2 * len(cfg.sizes) + 1  # data, teacher, reference, imatrix, cache; train+export per size; card
    if cfg.eval:
        n += 2 * len(cfg.stock) + 1 + len(cfg.sizes)  # stock files, the eval base, one eval per file
    return n


@contextmanager
def open_ladder(cfg: QuantizeConfig, *, progress: bool = False) -> Iterator[Ladder]:
    """A ladder whose steps the caller runs in its own order (benchmarks: variants, uniform
    files, evaluations of their own), after the same preflight as :func:`quantize`."""
    from .preflight import preflight  # lazy: voodoo_quant.api imports this module

    pre = preflight(cfg)
    with LadderDisplay(progress, step_count(cfg)) as ui:
        yield Ladder(cfg, ui, pre)


def quantize(cfg: QuantizeConfig, *, progress: bool = True) -> QuantizeResult:
    """Run (or resume) the ladder; bad input is refused before any step starts."""
    from .preflight import preflight  # lazy: voodoo_quant.api imports this module

    if progress:  # one display: the libraries' own per-file bars would break it up
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    pre = preflight(cfg)
    with LadderDisplay(progress, step_count(cfg)) as ui:
        return Ladder(cfg, ui, pre).run()
