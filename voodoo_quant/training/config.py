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

DTYPES = ("float32", "bfloat16", "float16")
METHODS = ("gates", "sensitivity")
SENSITIVITY_KINDS = ("fisher", "output", "measured")
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


@dataclass
class TrainConfig:
    # model and teacher
    model: str = ""
    base_checkpoint: str | None = None
    text_model_class: str | None = None
    teacher_quant: str | None = None  # None (float teacher) or "Q8_0"
    teacher_checkpoint: str | None = None
    # budget
    compression_ratio: float | None = None
    target_bits: float | None = None
    budget_reduction: float = 0.0
    size_weight: float = 100.0
    size_tolerance: float = 0.02
    tensor_upgrades: str | None = None
    # menus
    candidate_types: tuple[str, ...] = DEFAULT_CANDIDATES
    attention_candidates: tuple[str, ...] | None = None
    non_attention_candidates: tuple[str, ...] | None = None
    # a menu that falls back on a tensor's row length also takes the row's other types in its size
    # range (menus.py); None: yes for the default menu, no for one the user names
    fill_menus: bool | None = None
    imatrix: str | None = None
    # optimization
    seq_len: int = 512
    batch_size: int = 1
    max_steps: int = 100
    lr: float = 0.5
    distill_weight: float = 1.0  # λ of the KL(teacher‖student) term
    tau_start: float = 1.0
    tau_end: float = 0.05
    seed: int = 0
    # data and outputs
    data_dir: str = "data"
    data_name: str = "train_tokens.pt"
    output_dir: str = "runs/voodoo"
    output_name: str = "voodoo.pt"
    # hardware
    device: str = "cpu"
    dtype: str = "float32"
    lazy: bool = False
    gradient_checkpointing: bool = False
    no_compile: bool = False
    tensor_parallel: int = 1
    device_map: str | None = None
    # journal
    partial_save_interval: int = 10
    resume: bool = True
    dry_run: bool = False
    # beyond the soft mixture: see training/{routing,sensitivity,knapsack,losses}.py
    method: str = "gates"  # "gates" (train) or "sensitivity" (greedy knapsack only, no training)
    ptqr: bool = False  # per-token routing: each token through one sampled candidate
    st_gumbel_fraction: float = 0.0  # last fraction of steps with straight-through Gumbel hardening
    st_gumbel_tau: float = 0.5
    # Defaults from the method comparison at Voodoo65 on SmolLM2 (docs/lab/, 2026-11-30):
    # warm start + polish gave the lowest KLD of the five variants measured.
    warm_start: bool = True  # gates start concentrated on the sensitivity knapsack's layout
    warm_start_mass: float = 0.9  # probability of the layout's rung at step 0
    sensitivity_sequences: int = 4  # calibration sequences for the sensitivity table
    sensitivity_kind: str = "fisher"  # "fisher" (ΔKL from the Fisher diagonal), "output" (own output error), "measured" (ΔKL measured per rung)
    relaxation_gap: bool = False  # add the expected one-hot KL's variance term to the loss (relaxation.py)
    polish: bool = True  # knapsack polish of the baked assignment inside the dead zone
    loss_chunk_size: int = 1024  # tokens per LM-head chunk of the losses (0: whole logits); 1024 fits the 27B TP-4 recipe
    grad_accum_steps: int = 1
    teacher_device: str | None = None  # default: --device
    log_file: str | None = None  # JSONL run log (default: <output_dir>/train_log.jsonl)
    finalize_from_partial: str | None = None  # redo only the bake from this journal
    resume_from_partial: str | None = None  # resume from this journal (default: <output_dir>/partial.pt)
    # after the bake: training/{guarantee,search,objective}.py
    search_sequences: int = 8  # training sequences held aside (the last N) to measure KL on
    # measured-KL evaluations of the final search; 0 (the default): none. Its kept moves fit the
    # held-aside sequences they were chosen on and raised the KL on other text (WHITEPAPER §4)
    search_evals: int = 0
    search_margin: float = 0.0  # keep a move only when its paired KL drop exceeds this many standard errors
    search_confirm: int = 0  # more sequences held aside: the search's result is written only if it beats its start there
    guarantee: bool = True  # measure uniform / stock / knapsack references and start from the best
    # error compensation (compensate.py): "gptq" hands the quantizer each tensor with every block's
    # rounding error passed on to the later columns, from layer-input Hessians (training/hessians.py;
    # under --lazy one decoder layer at a time); "auto" is gptq in one process, none under tensor parallelism
    error_compensation: str = "auto"
    compensation_sequences: int = 32  # calibration sequences of the Hessians (first N of the training tokens)
    compensation_damp: float = 0.1  # λ: H + λ·mean(diag H)·I
    stock_references: tuple[str, ...] = STOCK_REFERENCES  # llama-quantize ftypes measured by the guarantee

    @property
    def compensation(self) -> str:
        """The error compensation this run uses: ``--error_compensation``, with auto resolved to
        gptq in one process (under --lazy from Hessians collected one decoder layer at a time,
        the same bytes), or to none under tensor parallelism (no rank holds every layer's input)."""
        if self.error_compensation != "auto":
            return self.error_compensation
        return "none" if self.tensor_parallel > 1 else "gptq"

    def __post_init__(self) -> None:
        if self.fill_menus is None:  # before the default replaces an omitted menu
            self.fill_menus = default_fill(_types(self.candidate_types), self.attention_candidates,
                                           self.non_attention_candidates)
        self.candidate_types = _types(self.candidate_types) or DEFAULT_CANDIDATES
        self.attention_candidates = _types(self.attention_candidates)
        self.non_attention_candidates = _types(self.non_attention_candidates)
        self.stock_references = tuple(self.stock_references or ())
        if not self.model:
            raise ConfigError("--model is required (an HF checkpoint directory)")
        if (self.compression_ratio is None) == (self.target_bits is None):
            raise ConfigError("give exactly one of --compression_ratio and --target_bits")
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
        if self.error_compensation not in COMPENSATIONS:
            raise ConfigError(f"--error_compensation must be one of {', '.join(COMPENSATIONS)}, got {self.error_compensation!r}")
        if not isinstance(self.compensation_sequences, int) or isinstance(self.compensation_sequences, bool) \
                or self.compensation_sequences < 1:
            raise ConfigError(f"--compensation_sequences must be an integer >= 1, got {self.compensation_sequences!r}")
        if not (isinstance(self.compensation_damp, (int, float)) and 0 < self.compensation_damp < 1e3):
            raise ConfigError(f"--compensation_damp must be a number > 0, got {self.compensation_damp!r}")
        if self.error_compensation == "gptq" and self.tensor_parallel > 1:
            raise ConfigError("--error_compensation needs every layer's whole input in one process: "
                              "not supported under --tensor_parallel yet")
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

    # Fields that do not change the result: a run may resume with different values (``lazy``
    # among them: its candidates, compensated or not, are the eager run's). result_hash counts the
    # compensation ``auto`` resolves to.
    _RESULT_NEUTRAL = ("output_dir", "output_name", "partial_save_interval", "resume", "dry_run",
                       "no_compile", "gradient_checkpointing", "device", "device_map", "lazy",
                       # exact reformulations and bake-only settings: a journal stays valid across them
                       "loss_chunk_size", "teacher_device", "log_file", "finalize_from_partial",
                       "resume_from_partial", "polish", "search_evals", "search_margin", "guarantee",
                       "stock_references")

    # Fields that do not change what a finished run writes (up to float summation order): a ladder's
    # step cache (`voodoo quantize`) reuses a size's training across them.
    OUTPUT_NEUTRAL = ("partial_save_interval", "resume", "dry_run", "no_compile", "loss_chunk_size", "log_file")

    def result_hash(self) -> str:
        """Hash of the settings that determine the result (journal compatibility). The error
        compensation counts as resolved: ``auto`` is gptq in one process (eager or --lazy) and
        none under tensor parallelism, whose candidates differ."""
        d = {k: v for k, v in self.to_dict().items() if k not in self._RESULT_NEUTRAL}
        d["error_compensation"] = self.compensation
        if self.compensation == "none":  # their values reach nothing without compensation
            del d["compensation_sequences"], d["compensation_damp"]
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
