"""``TrainConfig``: every ``voodoo train`` flag, validated once, shared by the CLI and the API."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..core import qtypes as qt
from ..core.errors import ConfigError
from ..selection.menus import DEFAULT_CANDIDATES, MenuConfig, default_fill, parse_upgrades
from ..core.settings import ADVANCED, EXPERIMENTAL, NOTHING, OUTPUT, TRAINING, key_dict, setting, unchanged_by
from ..core.sizes import parse_size

# Tokens per training sequence, shared by every command that trains (train, quantize, the API):
# one default per idea. `voodoo data` keeps its own (2048): it tokenizes a corpus once for any
# run, and a run reads a shorter --seq_len from the longer sequences (training/setup.py load_tokens).
SEQ_LEN = 512

DTYPES = ("float32", "bfloat16", "float16")
METHODS = ("gates", "sensitivity")
SENSITIVITY_KINDS = ("fisher", "output", "measured")
MEMORY_CHECKS = ("auto", "warn", "off")  # --memory_check (tools/memory_check.py)
COMPENSATIONS = ("auto", "gptq", "none")  # --error_compensation (compensate.py); auto: see TrainConfig.compensation
# The llama-quantize recipes the guarantee compares with (those that fit the budget; recipes.py).
STOCK_REFERENCES = ("IQ1_S", "IQ1_M", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "Q2_K_S", "Q2_K", "IQ3_XXS", "IQ3_XS",
                    "IQ3_S", "IQ3_M", "Q3_K_S", "Q3_K_M", "Q3_K_L", "IQ4_NL", "IQ4_XS", "Q4_0", "Q4_1", "Q4_K_S",
                    "Q4_K_M", "Q5_0", "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0")


def _types(v: Any) -> tuple[str, ...] | None:
    if v is None:
        return None
    if isinstance(v, str):
        v = [v]
    out: list[str] = []
    for item in v:
        out.extend(p for p in str(item).replace(",", " ").split() if p)
    return tuple(qt.get(t).name for t in out) if out else None


LAB_MODES = "docs/lab/2026-11-30-first-benchmark-and-training-modes.md"
LAB_FISHER = "docs/lab/2026-12-01-fisher-sensitivity-guarantee-search.md"
LAB_SEARCH = "docs/lab/2026-12-03-search-transfer-and-confirmation.md"

# Panels of `voodoo train --help`: the main ones, then settings.ADVANCED and settings.EXPERIMENTAL.
MODEL, SIZE, MENUS, TRAIN, HARDWARE = "Model and data", "Size", "Menus", "Training", "Hardware"


@dataclass
class TrainConfig:
    """Every ``voodoo train`` setting, declared once (``settings.py``): the CLI's options, the
    journal's ``result_hash`` and the ladder's cache key are read from these fields."""

    # model and teacher
    model: str = setting("", help="HF checkpoint dir (config, tokenizer, safetensors).", panel=MODEL, required=True)
    base_checkpoint: str | None = setting(None, help="Base .pt state dict (from make-teacher) replacing the checkpoint's weights.", panel=ADVANCED)
    text_model_class: str | None = setting(None, help="Text-only class/model_type of a multimodal wrapper, e.g. qwen3_5_text.", panel=ADVANCED)
    teacher_quant: str | None = setting(None, help="Teacher weights: omit for the float model, Q8_0 for its llama.cpp-exact Q8_0.", panel=ADVANCED)
    teacher_checkpoint: str | None = setting(None, help="Teacher .pt state dict (from make-teacher).", panel=ADVANCED)
    # budget
    compression_ratio: float | None = setting(None, help="Target size as a fraction of the selectable tensors at uniform Q8_0 (Voodoo45 = 0.45).", panel=SIZE)
    target_bits: float | None = setting(None, help="Target bits per selectable weight.", panel=SIZE)
    target_size: str | None = setting(None, help="Target size of the whole GGUF file (metadata and every tensor counted, as llama-quantize --target-size): 1.2GB, 800MiB or bytes.", panel=SIZE, metavar="SIZE", omit_at_default=True)
    budget_reduction: float = setting(0.0, help="Train toward target × (1 − this) so post-hoc --tensor_upgrades land on target.", panel=ADVANCED)
    size_weight: float = setting(100.0, help="Weight of the quadratic size penalty outside the dead zone.", panel=ADVANCED)
    size_tolerance: float = setting(0.02, help="Dead zone: no size penalty within ±this fraction of the target.", panel=ADVANCED)
    tensor_upgrades: str | None = setting(None, help='JSON list of {"pattern": regex, "levels": ±n}: move matching tensors n rungs after the argmax.', panel=ADVANCED)
    # menus
    candidate_types: tuple[str, ...] = setting(DEFAULT_CANDIDATES, help=f"Default menu (space or comma separated); default: {' '.join(DEFAULT_CANDIDATES)}.", panel=MENUS)
    attention_candidates: tuple[str, ...] | None = setting(None, help="Menu of the attention family (the adapter's attention_segments).", panel=MENUS)
    non_attention_candidates: tuple[str, ...] | None = setting(None, help="Menu of every other tensor.", panel=MENUS)
    # a menu that falls back on a tensor's row length also takes the row's other types in its size
    # range (menus.py); None: yes for the default menu, no for one the user names
    fill_menus: bool | None = setting(None, help="Where a menu's types fall back on a tensor's row length (rows not a multiple of 256), also offer every other type that row takes within the menu's size range. Default: on for the default menu, off for a menu you name.", panel=ADVANCED)
    imatrix: str | None = setting(None, help="llama.cpp imatrix (GGUF or legacy .dat); required for IQ2_XXS/IQ2_XS/IQ1_S and others.", panel=MODEL)
    # optimization
    seq_len: int = setting(SEQ_LEN, help="Tokens per sequence.", panel=TRAIN)
    batch_size: int = setting(1, help="Sequences per step.", panel=TRAIN)
    max_steps: int = setting(100, help="Gate training steps.", panel=TRAIN, aliases=("steps",))
    lr: float = setting(0.5, help="Adam learning rate of the gate logits.", panel=TRAIN)
    distill_weight: float = setting(1.0, help="λ: weight of KL(teacher ‖ student).", panel=ADVANCED)
    tau_start: float = setting(1.0, help="Softmax temperature at the first step.", panel=ADVANCED)
    tau_end: float = setting(0.05, help="Temperature at the last step (geometric annealing).", panel=ADVANCED)
    seed: int = setting(0, help="Seed of the batch order.", panel=TRAIN)
    # data and outputs
    data_dir: str = setting("data", help="Directory of the tokens file.", panel=MODEL)
    data_name: str = setting("train_tokens.pt", help="Tokens file written by `voodoo data`.", panel=MODEL)
    output_dir: str = setting("runs/voodoo", help="Where the journal and the outputs go.", panel=MODEL, changes=OUTPUT)
    output_name: str = setting("voodoo.pt", help="Name of the result .pt (assignment, gates, config, metrics).", panel=ADVANCED, changes=OUTPUT)
    # hardware (a device changes the float summation order, hence a ladder's step; not the journal)
    device: str = setting("cpu", help="cpu, cuda or cuda:N (ROCm GPUs are cuda:N too).", panel=HARDWARE, changes=OUTPUT)
    dtype: str = setting("float32", help="Training dtype: float32, bfloat16 or float16.", panel=HARDWARE)
    lazy: bool = setting(False, help="Keep candidates packed; dequantize on the fly (less memory).", panel=HARDWARE, changes=OUTPUT)
    gradient_checkpointing: bool = setting(False, help="Recompute activations in backward.", panel=HARDWARE, changes=OUTPUT)
    no_compile: bool = setting(False, help="Accepted for old command lines; does nothing.", hidden=True, changes=NOTHING)
    tensor_parallel: int = setting(1, help="Tensor-parallel degree (run through `voodoo tp`).", panel=HARDWARE)
    device_map: str | None = setting(None, help="Layer-wise placement, e.g. cuda:0,cuda:1.", panel=ADVANCED, changes=OUTPUT)
    # before anything loads: the memory plan of --dry_run (memory/), acted on by tools/memory_check.py
    memory_check: str = setting("auto", help="Before loading anything, plan the run's memory as --dry_run does. auto: when the plan does not fit the device (VOODOO_DEVICE_MEMORY_GB sets its size), turn on the settings that keep the result (--lazy; --gradient_checkpointing in one CPU process without a tied gated weight) if they make it fit, and stop with the plan's advice if they do not; warn: only say that it does not fit; off: no plan.", panel=ADVANCED, changes=NOTHING, metavar="auto|warn|off")
    # journal
    partial_save_interval: int = setting(10, help="Write the journal every N steps.", panel=ADVANCED, changes=NOTHING)
    resume: bool = setting(True, help="Resume from the journal in --output_dir if present.", panel=ADVANCED, changes=NOTHING)
    dry_run: bool = setting(False, help="Print every tensor's menu, bytes and the size range; train nothing.", panel=TRAIN, changes=NOTHING)
    # what writes the assignment: training/methods.py's registry
    method: str = setting("gates", help="gates: train the gates; sensitivity: the sensitivity knapsack's layout, baked (no training).", panel=ADVANCED)
    ptqr: bool = setting(False, help="Per-token routing: each token through one candidate sampled from the gates; straight-through gate gradient.", panel=EXPERIMENTAL, lab=LAB_MODES)
    st_gumbel_fraction: float = setting(0.0, help="Last fraction of steps with straight-through Gumbel hardening (one candidate per tensor; exclusive with --ptqr).", panel=EXPERIMENTAL, lab=LAB_MODES)
    st_gumbel_tau: float = setting(0.5, help="Temperature of the straight-through Gumbel softmax.", panel=EXPERIMENTAL, lab=LAB_MODES)
    warm_start: bool = setting(True, help="Start the gates on the sensitivity knapsack's layout; off: from a prior in bits around the target.", panel=ADVANCED)
    warm_start_mass: float = setting(0.9, help="Probability of the layout's rung at step 0 under --warm_start.", panel=ADVANCED)
    sensitivity_sequences: int = setting(4, help="Calibration sequences of the sensitivity table (first N of the tokens file).", panel=ADVANCED)
    sensitivity_kind: str = setting("fisher", help="Sensitivity table of the knapsack, warm start and polish: fisher (ΔKL predicted from the Fisher diagonal), measured (every rung's ΔKL measured with that one tensor quantized; one process only) or output (each tensor's own imatrix-weighted output error).", panel=EXPERIMENTAL, lab=LAB_FISHER)
    relaxation_gap: bool = setting(False, help="Add to the loss the KL the soft mixture hides from a one-hot file (from the Fisher curvature), so the gates descend the expected KL of the file they bake.", panel=EXPERIMENTAL, negatable=True, lab=LAB_FISHER)
    polish: bool = setting(True, help="After the bake: one-rung moves ranked by sensitivity benefit per byte, inside the dead zone.", panel=ADVANCED, changes=OUTPUT)
    loss_chunk_size: int = setting(1024, help="Tokens per LM-head chunk of CE/KL (exact; 0: whole logits).", panel=ADVANCED, changes=NOTHING)
    grad_accum_steps: int = setting(1, help="Micro-batches of --batch_size per optimizer step.", panel=ADVANCED)
    teacher_device: str | None = setting(None, help="Device of the teacher (default: --device), e.g. cpu.", panel=ADVANCED, changes=OUTPUT)
    log_file: str | None = setting(None, help="JSONL run log, one line per step (default: <output_dir>/train_log.jsonl).", panel=ADVANCED, changes=NOTHING)
    finalize_from_partial: str | None = setting(None, help="Redo only the bake from this journal (partial.pt); no training.", panel=ADVANCED, changes=OUTPUT)
    resume_from_partial: str | None = setting(None, help="Resume training from this journal instead of <output_dir>/partial.pt.", panel=ADVANCED, changes=OUTPUT)
    # after the bake: training/{guarantee,objective}.py, experimental/search.py
    search_sequences: int = setting(8, help="Training sequences held aside (the last N, at most a quarter of the file) on which the guarantee measures KL(teacher ‖ baked student); 0: none (no guarantee).", panel=ADVANCED)
    search_evals: int = setting(0, help="Measured-KL evaluations of a local search from the guarantee's choice (one-rung moves and up/down pairs ranked by the gates' gradient, kept when the measured KL drops); 0: no search.", panel=EXPERIMENTAL, changes=OUTPUT, lab=LAB_SEARCH)
    search_margin: float = setting(0.0, help="Keep a search move only when its KL drop, paired over the held-aside sequences, exceeds this many standard errors (0: any drop).", panel=EXPERIMENTAL, changes=OUTPUT, lab=LAB_SEARCH)
    search_confirm: int = setting(0, help="More training sequences held aside (before the search's); the search's result is written only when its KL there is below its start's (0: no check).", panel=EXPERIMENTAL, lab=LAB_SEARCH)
    guarantee: bool = setting(True, help="Measure the best uniform types, the stock llama-quantize recipes and both knapsacks that fit the budget beside the gates' bake, and write the best.", panel=ADVANCED, changes=OUTPUT)
    # error compensation (compensate.py): "gptq" hands the quantizer each tensor with every block's
    # rounding error passed on to the later columns, from layer-input Hessians (training/hessians.py;
    # under --lazy one decoder layer at a time; under tensor parallelism by rank 0); "auto" is gptq
    error_compensation: str = setting("auto", help="gptq: each tensor is quantized by the same quantizer with every block's rounding error passed on to its later columns, from the layer inputs' Hessians on calibration text (stock llama-quantize writes the same types, not these bytes); none: the weights as they are (the bytes stock llama-quantize writes); auto: gptq.", panel=ADVANCED)
    compensation_sequences: int = setting(32, help="Calibration sequences of the Hessians under --error_compensation gptq (first N of the training tokens).", panel=ADVANCED)
    compensation_damp: float = setting(0.1, help="Damping of the Hessians: H + λ·mean(diag H)·I.", panel=ADVANCED)
    # the walk's rounding oracle (compensate.py, whose DEFAULT_SWEEP this default is: a test keeps
    # them equal; imported lazily there, so it is written here)
    compensation_sweep: str = setting("packed", help="How the compensation walk rounds a 256-weight superblock's 32-column steps: packed (K-quants and IQ4_XS quantized once when the walk reaches them, later steps rounded with their scales, the file holding those codes at those scales; each step of IQ3_S, IQ2_S and IQ1_S from the quantizer on a probe of 8 rows' 32 columns, with the probe's own weights and scale; IQ3_XXS and IQ2_XXS as proxy rounds them; IQ2_XS as ruled), ruled (as packed, but a grid IQ superblock quantized once when the walk reaches it, each later step's probe weighted as its own superblock weighs it and its scale coded against the superblock's largest), fixed (every grid IQ step quantized again with its whole superblock), requant (every step quantized again with its superblock) or proxy (as ruled, with the steps of Q8_0, Q4_K, Q5_K and the grid IQ types but IQ1_M rounded in torch by a model of the quantizer). The bytes are libggml-base's format either way, and what training reads.", panel=ADVANCED)
    stock_references: tuple[str, ...] = setting(STOCK_REFERENCES, help="llama-quantize ftypes the guarantee considers (default: all; the largest three that fit are measured).", panel=ADVANCED, changes=OUTPUT)

    @property
    def compensation(self) -> str:
        """The error compensation this run uses: ``--error_compensation``, with auto resolved to
        gptq (under --lazy and tensor parallelism from Hessians collected one decoder layer at a
        time, on rank 0: the same bytes as one process reading the model whole)."""
        return "gptq" if self.error_compensation == "auto" else self.error_compensation

    def __post_init__(self) -> None:
        if self.fill_menus is None:  # before the default replaces an omitted menu
            self.fill_menus = default_fill(_types(self.candidate_types), self.attention_candidates,
                                           self.non_attention_candidates)
        self.candidate_types = _types(self.candidate_types) or DEFAULT_CANDIDATES
        self.attention_candidates = _types(self.attention_candidates)
        self.non_attention_candidates = _types(self.non_attention_candidates)
        refs = self.stock_references
        refs = [refs] if isinstance(refs, str) else list(refs or ())
        self.stock_references = tuple(p for r in refs for p in str(r).replace(",", " ").split() if p)
        if not self.model:
            raise ConfigError("--model is required (an HF checkpoint directory)")
        given = [f for f in ("compression_ratio", "target_bits", "target_size") if getattr(self, f) is not None]
        if len(given) != 1:
            raise ConfigError("give exactly one of --compression_ratio, --target_bits and --target_size"
                              + (f" (got {', '.join('--' + g for g in given)})" if given else ""))
        if self.target_size is not None:
            parse_size(self.target_size, "--target_size")  # refused now, not after loading the model
        if self.teacher_quant is not None:
            tq = qt.get(self.teacher_quant).name
            if tq != "Q8_0":
                raise ConfigError(f"--teacher_quant supports Q8_0 only (got {self.teacher_quant})")
            self.teacher_quant = tq
        for flag, v, lo in (("--seq_len", self.seq_len, 2), ("--batch_size", self.batch_size, 1),
                            ("--max_steps", self.max_steps, 1), ("--partial_save_interval", self.partial_save_interval, 1),
                            ("--tensor_parallel", self.tensor_parallel, 1)):
            if not isinstance(v, int) or v < lo:
                raise ConfigError(f"{flag} must be an integer >= {lo}, got {v!r}")
        for flag, v in (("--lr", self.lr), ("--tau_start", self.tau_start), ("--tau_end", self.tau_end)):
            if not v > 0:
                raise ConfigError(f"{flag} must be > 0, got {v}")
        if self.tau_end > self.tau_start:
            raise ConfigError(f"--tau_end ({self.tau_end}) must not exceed --tau_start ({self.tau_start})")
        if self.size_weight < 0 or self.distill_weight < 0:
            raise ConfigError("--size_weight and --distill_weight must be >= 0")
        if not 0 <= self.size_tolerance < 1:
            raise ConfigError(f"--size_tolerance must be in [0, 1), got {self.size_tolerance}")
        if not 0 <= self.budget_reduction < 1:
            raise ConfigError(f"--budget_reduction must be in [0, 1), got {self.budget_reduction}")
        if self.dtype not in DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(DTYPES)}, got {self.dtype!r}")
        if self.tensor_parallel > 1 and self.device_map:
            raise ConfigError("--tensor_parallel and --device_map are exclusive: pick one way to spread the model")
        if not self.output_name.endswith(".pt"):
            raise ConfigError(f"--output_name must end in .pt, got {self.output_name!r}")
        if "/" in self.output_name or "\\" in self.output_name or self.output_name.startswith(".."):
            raise ConfigError(f"--output_name {self.output_name!r} must be a plain file name inside --output_dir")
        self._validate_beyond()
        parse_upgrades(self.tensor_upgrades)  # validates JSON and regexes now, not after training
        self.menus  # validates types

    def _validate_beyond(self) -> None:
        if self.method not in METHODS:
            raise ConfigError(f"--method must be one of {', '.join(METHODS)}, got {self.method!r}")
        for flag, v, lo in (("--sensitivity_sequences", self.sensitivity_sequences, 1),
                            ("--loss_chunk_size", self.loss_chunk_size, 0),
                            ("--grad_accum_steps", self.grad_accum_steps, 1),
                            ("--search_sequences", self.search_sequences, 0),
                            ("--search_evals", self.search_evals, 0),
                            ("--search_confirm", self.search_confirm, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{flag} must be an integer >= {lo}, got {v!r}")
        if not (isinstance(self.search_margin, (int, float)) and self.search_margin >= 0):
            raise ConfigError(f"--search_margin must be a number >= 0, got {self.search_margin!r}")
        if self.memory_check not in MEMORY_CHECKS:
            raise ConfigError(f"--memory_check must be one of {', '.join(MEMORY_CHECKS)}, got {self.memory_check!r}")
        if self.error_compensation not in COMPENSATIONS:
            raise ConfigError(f"--error_compensation must be one of {', '.join(COMPENSATIONS)}, got {self.error_compensation!r}")
        if not isinstance(self.compensation_sequences, int) or isinstance(self.compensation_sequences, bool) \
                or self.compensation_sequences < 1:
            raise ConfigError(f"--compensation_sequences must be an integer >= 1, got {self.compensation_sequences!r}")
        from ..candidates.compensate import SWEEPS  # lazy: `voodoo --help` builds train's options from this module

        if self.compensation_sweep not in SWEEPS:
            raise ConfigError(f"--compensation_sweep must be one of {', '.join(SWEEPS)}, got {self.compensation_sweep!r}")
        if not (isinstance(self.compensation_damp, (int, float)) and 0 < self.compensation_damp < 1e3):
            raise ConfigError(f"--compensation_damp must be a number > 0, got {self.compensation_damp!r}")
        if self.sensitivity_kind not in SENSITIVITY_KINDS:
            raise ConfigError(f"--sensitivity_kind must be one of {', '.join(SENSITIVITY_KINDS)}, got {self.sensitivity_kind!r}")
        if self.sensitivity_kind == "measured" and self.tensor_parallel > 1:
            raise ConfigError("--sensitivity_kind measured runs the whole model in one process: "
                              "under --tensor_parallel use --sensitivity_kind fisher")
        if not 0.0 <= self.st_gumbel_fraction <= 1.0:
            raise ConfigError(f"--st_gumbel_fraction must be in [0, 1], got {self.st_gumbel_fraction}")
        if not self.st_gumbel_tau > 0:
            raise ConfigError(f"--st_gumbel_tau must be > 0, got {self.st_gumbel_tau}")
        if self.ptqr and self.st_gumbel_fraction > 0:
            raise ConfigError("--ptqr and --st_gumbel_fraction are exclusive: pick one hard forward")
        if not 0.0 < self.warm_start_mass < 1.0:
            raise ConfigError(f"--warm_start_mass must be in (0, 1), got {self.warm_start_mass}")
        if self.finalize_from_partial and self.resume_from_partial:
            raise ConfigError("--finalize_from_partial and --resume_from_partial are exclusive")
        if self.method == "sensitivity" and (self.finalize_from_partial or self.resume_from_partial):
            raise ConfigError("--method sensitivity trains nothing: it takes no journal")

    @property
    def needs_sensitivity(self) -> bool:
        """Whether a sensitivity table is read: the warm start, polish, the one-shot method, the
        relaxation gap, or the post-bake measurements (the guarantee's knapsack reference and the
        search's curvature)."""
        return (self.warm_start or self.polish or self.method == "sensitivity"
                or (self.method == "gates" and (self.relaxation_gap or self.measures)))

    @property
    def measures(self) -> bool:
        """Whether the bake is followed by measurements on held-aside sequences: the guarantee and
        the search (a tensor-parallel run measures the guarantee's menu-type candidates, and
        searches, across its ranks)."""
        return (self.method == "gates" and (self.guarantee or self.searches) and self.search_sequences > 0)

    @property
    def searches(self) -> bool:
        """Whether the measured-KL search runs after the guarantee."""
        return self.method == "gates" and self.search_evals > 0 and self.search_sequences > 0

    @property
    def log_path(self) -> Path:
        return Path(self.log_file) if self.log_file else self.out_dir / "train_log.jsonl"

    @property
    def menus(self) -> MenuConfig:
        return MenuConfig(self.candidate_types, self.attention_candidates, self.non_attention_candidates,
                          fill=bool(self.fill_menus))

    @property
    def upgrades(self):
        return parse_upgrades(self.tensor_upgrades)

    @property
    def out_dir(self) -> Path:
        return Path(self.output_dir)

    @property
    def data_path(self) -> Path:
        return Path(self.data_dir) / self.data_name

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        for k, v in d.items():
            if isinstance(v, tuple):
                d[k] = list(v)
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "TrainConfig":
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - names
        if unknown:
            raise ConfigError(f"unknown train config keys: {', '.join(sorted(unknown))}")
        return cls(**d)

    @classmethod
    def unchanged_by(cls, what: str) -> tuple[str, ...]:
        """The settings that do not change the training (``TRAINING``: a run may resume with other
        values; ``lazy`` among them, whose candidates, compensated or not, are the eager run's)
        or what a finished run writes (``OUTPUT``, up to float summation order: a ladder's step
        cache reuses a size's training across them). Read from the fields (``settings.py``)."""
        return unchanged_by(cls, what)

    def result_hash(self) -> str:
        """Hash of the settings that determine the result (journal compatibility). The error
        compensation counts as resolved (``auto`` is gptq), so a journal trained on plain
        candidates (an older tensor-parallel run's auto) is not resumed on compensated ones."""
        d = key_dict(self, TRAINING)
        d["error_compensation"] = self.compensation
        if self.compensation == "none":  # their values reach nothing without compensation
            del d["compensation_sequences"], d["compensation_damp"], d["compensation_sweep"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


# Every setting's default, for the commands that restate a training run's settings (precache).
TRAIN_DEFAULTS: dict[str, Any] = {f.name: f.default for f in dataclasses.fields(TrainConfig)}
