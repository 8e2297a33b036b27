"""``TrainConfig``: every ``voodoo train`` flag, validated once, shared by the CLI and the API."""

from __future__ import annotations

import dataclasses
import hashlib
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .. import qtypes as qt
from ..errors import ConfigError
from ..menus import DEFAULT_CANDIDATES, MenuConfig, parse_upgrades

DTYPES = ("float32", "bfloat16", "float16")


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

    def __post_init__(self) -> None:
        self.candidate_types = _types(self.candidate_types) or DEFAULT_CANDIDATES
        self.attention_candidates = _types(self.attention_candidates)
        self.non_attention_candidates = _types(self.non_attention_candidates)
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
        parse_upgrades(self.tensor_upgrades)  # validates JSON and regexes now, not after training
        self.menus  # validates types

    @property
    def menus(self) -> MenuConfig:
        return MenuConfig(self.candidate_types, self.attention_candidates, self.non_attention_candidates)

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

    # Fields that do not change the result: a run may resume with different values.
    _RESULT_NEUTRAL = ("output_dir", "output_name", "partial_save_interval", "resume", "dry_run",
                       "no_compile", "gradient_checkpointing", "device", "device_map", "lazy")

    def result_hash(self) -> str:
        """Hash of the settings that determine the result (journal compatibility)."""
        d = {k: v for k, v in self.to_dict().items() if k not in self._RESULT_NEUTRAL}
        return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]
