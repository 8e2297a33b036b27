"""A variant of a ladder's file per size: the same data, teacher, reference and imatrix, other
train settings (``Ladder.train(size, variant)`` / ``Ladder.export(size, variant)``).

Benchmarks compare methods this way on one ladder: the written file against the knapsacks, other
step counts or seeds, without a second pipeline.
"""

from __future__ import annotations

import dataclasses
import re
from dataclasses import dataclass, field
from typing import Any

from ..core.errors import ConfigError
from ..training.config import TrainConfig

# What a Variant may not override: where the run reads and writes, and its size (the ladder's).
_VARIANT_OWNED = {"model", "data_dir", "data_name", "output_dir", "output_name", "imatrix", "compression_ratio",
                  "target_bits", "dry_run", "tensor_parallel", "finalize_from_partial", "resume_from_partial", "log_file"}


@dataclass
class Variant:
    """Another file per size beside the ladder's own, made from the same data, teacher, reference
    and imatrix (benchmarks compare methods this way). ``name`` tags its run, its steps and its
    file (``work/variants/<Model>.Voodoo<NN>-<name>.gguf``); ``train`` overrides the ladder's
    train settings, e.g. ``{"method": "sensitivity", "error_compensation": "none"}``."""

    name: str
    train: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", self.name or ""):
            raise ConfigError(f"variant name {self.name!r}: letters, digits, '.', '_' and '-' only")
        fields = {f.name for f in dataclasses.fields(TrainConfig)}
        bad = sorted(set(self.train) - fields)
        if bad:
            raise ConfigError(f"variant {self.name}: unknown train settings {', '.join(bad)}")
        owned = sorted(set(self.train) & _VARIANT_OWNED)
        if owned:
            raise ConfigError(f"variant {self.name}: {', '.join(owned)} belong to the ladder")

    def apply(self, tcfg: TrainConfig) -> TrainConfig:
        return dataclasses.replace(tcfg, **self.train)
