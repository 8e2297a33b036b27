"""What the quality benchmark makes: its settings (:class:`BenchConfig`), one file to make
(:class:`Item`) and the work order (:func:`plan`; ``quality.py``'s docstring says it in words).

The seeds (``--seeds``): the first everywhere, the others at ``--fair_sizes``, for the written file
and for every knapsack of ``--methods`` alike (``voodoo train --seed`` also picks the sequences of
the knapsack's Fisher pass, so its file has a seed spread too). A knapsack made at the product's
default seed carries no seed (``Item.seed`` None): its label, run folder and row identity are those
it had before knapsacks took seeds; at another seed they carry ``-seed<N>`` and the seed."""

from __future__ import annotations


from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import quality_texts as texts_mod

from voodoo_quant.core import envs
from voodoo_quant.tools.variant import Variant
from voodoo_quant.training.config import STOCK_REFERENCES, TrainConfig

ROOT = Path(__file__).resolve().parents[1]

BENCH_NAME = "qwen2.5-coder-1.5b"  # the name of the benchmark model's results
FLOOR = "Q8_0"
# the written file; --method sensitivity, gptq / none; gptq with a named --compensation_sweep.
# "knapsack-gptq" is the product's default walk, made as the method that names it
# (knapsack-gptq-packed): rows keyed "knapsack-gptq" were made while "ruled" was the default, and
# carry their walk in their config (the report names them by it)
WALKS = ("packed", "ruled")
METHODS = ("voodoo", "knapsack-gptq", "knapsack", *(f"knapsack-gptq-{w}" for w in WALKS))
DEFAULT_METHODS = METHODS[:3]
# the ruled walk's files were made as "knapsack-gptq" while it was the product's default: a row's
# identity keeps that name, so those rows are this method's
LEGACY_KEYS = {"knapsack-gptq-ruled": "knapsack-gptq"}
UNIFORM = ("IQ2_S", "IQ3_S", "Q3_K_S", "IQ4_XS", "Q4_K_S", "Q5_K_S", "Q6_K")
SIZES = ("min", 25, 30, 35, 40, 45, 55, 65, 75, 85, 95)
SHARED_STEPS = ("data", "make-teacher", "reference", "imatrix", "candidate-cache")
# the seed a knapsack Item without one is made at (voodoo train --seed's default)
DEFAULT_SEED = TrainConfig.__dataclass_fields__["seed"].default


@dataclass
class BenchConfig:
    model: Path | None = None  # default: the de-gridded benchmark teacher (make bench-models)
    degrid_seed: int | None = None  # de-grid a model whose weights are a dequantized quant (a GGUF)
    name: str | None = None  # results name; default qwen2.5-coder-1.5b for the benchmark model
    results: Path | None = None  # default docs/results/<name>.jsonl
    work: Path | None = None  # default <VOODOO_CACHE_DIR>/bench/<name>: kept across checkouts
    sizes: tuple = SIZES  # percent of uniform Q8_0; "min": the smallest the menus reach (and none below)
    methods: tuple[str, ...] = DEFAULT_METHODS
    stock: tuple[str, ...] = STOCK_REFERENCES  # IQ1_S .. Q8_0
    uniform: tuple[str, ...] = UNIFORM
    steps: tuple[int, ...] = (50, 10, 100)  # the first everywhere, the others at --fair_sizes
    seeds: tuple[int, ...] = (0, 1, 2)  # the first everywhere, the others at --fair_sizes (the knapsacks' too)
    fair_sizes: tuple[int, ...] = (25, 30, 35, 45)
    calib: tuple[str, ...] = texts_mod.DOMAINS
    plays_dir: Path | None = None
    python_dir: Path | None = None
    eval_fraction: float = 0.2
    split_seed: int = 0
    calib_chars: int = 600_000
    eval_chars: int = 200_000
    seq_len: int = 512
    calib_sequences: int = 64
    ctx: int = 512
    chunks: int = 32
    menu: tuple[str, ...] = ()  # --candidate_types; empty: the product's default menu
    device: str = "cpu"
    dtype: str = "float32"
    lazy: bool = False
    threads: int | None = None
    train_extra: dict[str, Any] = field(default_factory=dict)
    max_minutes: float | None = None
    keep_files: bool = False

    def __post_init__(self) -> None:
        from voodoo_quant.core import qtypes as qt
        from voodoo_quant.tools.bench_models import BenchModelsConfig
        from voodoo_quant.tools.quantize import default_model_name

        if self.model is None:
            self.model = BenchModelsConfig(progress=False).teacher_hf
            self.name = self.name or BENCH_NAME
        self.model = Path(self.model)
        if not (self.model / "config.json").is_file() and self.model.suffix.lower() != ".gguf":
            raise SystemExit(f"--model {self.model}: no HF checkpoint or GGUF there (the benchmark model: make bench-models)")
        self.name = self.name or default_model_name(self.model)
        self.results = Path(self.results or ROOT / "docs" / "results" / f"{self.name}.jsonl")
        self.work = Path(self.work or envs.cache_dir() / "bench" / self.name)
        self.sizes = tuple(s if s == "min" else int(s) for s in self.sizes)
        checks = [("--methods", self.methods, METHODS), ("--stock", self.stock, qt.LLAMA_FTYPES),
                  ("--uniform", self.uniform, qt.LLAMA_FTYPES), ("--calib", self.calib, texts_mod.DOMAINS)]
        for flag, given, known in checks:
            bad = [v for v in given if v not in known]
            if bad:
                raise SystemExit(f"{flag}: unknown {', '.join(bad)}; known: {', '.join(known)}")
        if not self.sizes or not self.steps or not self.seeds or not self.calib:
            raise SystemExit("--sizes, --steps, --seeds and --calib need at least one value each")
        if not set(self.fair_sizes) <= {s for s in self.sizes if s != "min"}:
            raise SystemExit(f"--fair_sizes {list(self.fair_sizes)} must be among --sizes {list(self.sizes)}")
        self.stock = tuple(dict.fromkeys([FLOOR, *self.stock]))  # the floor is always measured


@dataclass(frozen=True)
class Item:
    """One file to make: a stock or uniform recipe, or a method at a size (the written file at a
    step count and seed; a knapsack at the default seed, ``seed`` None, or at another)."""

    method: str  # stock | uniform | voodoo | knapsack | knapsack-gptq-<walk> (METHODS)
    recipe: str | None = None
    size: int | None = None
    steps: int | None = None
    seed: int | None = None

    @property
    def trained(self) -> bool:
        return self.method in METHODS

    @property
    def variant_name(self) -> str:
        if self.method == "voodoo":
            return f"s{self.steps}-seed{self.seed}"
        return self.method if self.seed is None else f"{self.method}-seed{self.seed}"

    @property
    def label(self) -> str:
        return f"Voodoo{self.size}-{self.variant_name}" if self.trained else f"{self.method}-{self.recipe}"

    def variant(self, extra: dict[str, Any]) -> Variant:
        own = {"voodoo": {"max_steps": self.steps, "seed": self.seed},
               "knapsack": {"method": "sensitivity", "error_compensation": "none"},
               **{f"knapsack-gptq-{w}": {"method": "sensitivity", "error_compensation": "gptq", "compensation_sweep": w}
                  for w in WALKS}}[self.method]
        if self.seed is not None:  # a knapsack's seed: the sequences of its Fisher pass
            own = {**own, "seed": self.seed}
        return Variant(self.variant_name, {**extra, **own})

    def key(self) -> dict[str, Any]:
        """The file's identity in a row (its digest's "file"): the fields set, so a knapsack at the
        default seed (None) keeps the identity of the rows made before knapsacks took seeds."""
        d = {k: v for k, v in asdict(self).items() if v is not None}
        return {**d, "method": LEGACY_KEYS.get(self.method, self.method)}


def resolve(method: str) -> str:
    """A method as it is made: "knapsack-gptq" (the product's default walk) as the method naming that walk."""
    from voodoo_quant.candidates.compensate import DEFAULT_SWEEP

    return f"knapsack-gptq-{DEFAULT_SWEEP}" if method == "knapsack-gptq" else method


def plan(cfg: BenchConfig, sizes: tuple[int, ...]) -> list[Item]:
    """Every file of the benchmark, in the order it is made (the module docstring)."""
    from voodoo_quant.core import qtypes as qt

    s0, seed0 = cfg.steps[0], cfg.seeds[0]
    items = [Item("stock", FLOOR)]
    for s in sizes:
        if "voodoo" in cfg.methods:
            items.append(Item("voodoo", size=s, steps=s0, seed=seed0))
        if qt.BADGES.get(s) in cfg.stock:
            items.append(Item("stock", qt.BADGES[s]))
    items += [Item("stock", r) for r in cfg.stock]
    items += [Item(resolve(m), size=s) for m in cfg.methods if m != "voodoo" for s in sizes]  # in the order asked
    items += [Item("uniform", r) for r in cfg.uniform]
    if "voodoo" in cfg.methods:
        items += [Item("voodoo", size=s, steps=s0, seed=x) for s in cfg.fair_sizes for x in cfg.seeds[1:]]
    # each knapsack at the other seeds, in the order --methods gives; one at the default seed is
    # the file made above (no seed), not a second copy of it
    items += [Item(resolve(m), size=s, seed=None if x == DEFAULT_SEED else x)
              for m in cfg.methods if m != "voodoo" for s in cfg.fair_sizes for x in cfg.seeds[1:]]
    if "voodoo" in cfg.methods:
        items += [Item("voodoo", size=s, steps=n, seed=seed0) for s in cfg.fair_sizes for n in cfg.steps[1:]]
    return list(dict.fromkeys(items))
