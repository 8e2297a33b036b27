"""The training journal (``partial.pt``): everything needed to resume a run bit-for-bit; and the
step log (``train_log.jsonl``, one :class:`StepMetrics` per line) that a resumed or finalized run reads back.

Written atomically every ``--partial_save_interval`` steps: gate logits, optimizer state, the
torch RNG state, the step (which is also the data position: batch order is a pure function of
the seed and the step), the hash of the result-determining config, and the error compensation
the candidates were built with (its method, damping and the key of the Hessians' inputs, which no
flag holds: the same flags on other weights or other text give other Hessians). A journal written
by a different config or on candidates of another compensation is refused, never silently mixed in.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..core import fileio
from ..core.errors import ConfigError, CorruptFileError

JOURNAL_NAME = "partial.pt"
JOURNAL_VERSION = 1


class JournalMismatchError(ConfigError):
    pass


@dataclass
class JournalState:
    step: int  # steps completed
    gates: dict[str, torch.Tensor]
    optimizer: dict[str, Any]
    rng: torch.Tensor
    config_hash: str
    config: dict[str, Any]
    # what the candidates were compensated with (compensation_of); None in a journal written
    # before the journal recorded it (then the config hash alone decides)
    compensation: dict[str, Any] | None = None


def compensation_of(record: dict[str, Any] | None) -> dict[str, Any]:
    """The identity of a run's error compensation, from its provenance record
    (``training/compensation.ensure``; None: no compensation): what a resume must find unchanged."""
    if not record:
        return {"method": "none"}
    out = {"method": str(record["method"]), "damp": float(record["damp"]), "hessians": str(record["key"])}
    if record.get("walk"):  # the walk's revision (candidates/compensate.revision): other candidates
        out["walk"] = str(record["walk"])
    return out


def _describe(c: dict[str, Any]) -> str:
    if c.get("method") == "none":
        return "no error compensation"
    walk = f", walk {c['walk']}" if c.get("walk") else ""
    return f"error compensation {c.get('method')} (damp {c.get('damp')}, Hessians of inputs {c.get('hessians')}{walk})"


def to_cpu(obj: Any) -> Any:
    """`obj` (tensors nested in dicts, lists, tuples) with every tensor on the CPU: a journal written
    on a GPU must load on any machine, and must not pin the GPU it was written on."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().cpu()
    if isinstance(obj, dict):
        return {k: to_cpu(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_cpu(v) for v in obj)
    return obj


def to_device(obj: Any, device: torch.device | str) -> Any:
    """`obj` with every tensor moved to `device` (Adam's scalar ``step`` stays on the CPU, as torch keeps it)."""
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, dict):
        return {k: (v if k == "step" else to_device(v, device)) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return type(obj)(to_device(v, device) for v in obj)
    return obj


def save(path: Path, state: JournalState) -> None:
    fileio.torch_save(
        path,
        {
            "journal_version": JOURNAL_VERSION,
            "step": state.step,
            "gates": {k: v.detach().cpu().clone() for k, v in state.gates.items()},
            "optimizer": to_cpu(state.optimizer),
            "rng": state.rng.cpu(),
            "config_hash": state.config_hash,
            "config_json": json.dumps(state.config, sort_keys=True),
            "compensation_json": None if state.compensation is None else json.dumps(state.compensation, sort_keys=True),
        },
    )


def load(path: Path, *, expect_hash: str, expect_names: set[str], expect_compensation: dict[str, Any] | None = None,
         device: torch.device | str | None = None) -> JournalState:
    """The journal at `path` (read onto the CPU); with `device`, its gates and optimizer state
    moved there (where the gates live). `expect_compensation` (compensation_of) is this run's:
    gates trained on candidates of another compensation are refused."""
    d = fileio.torch_load(path, what="journal")
    try:
        if d.get("journal_version") != JOURNAL_VERSION:
            raise CorruptFileError(f"journal {path}: unsupported version {d.get('journal_version')!r}")
        state = JournalState(
            step=int(d["step"]),
            gates=dict(d["gates"]),
            optimizer=d["optimizer"],
            rng=d["rng"],
            config_hash=str(d["config_hash"]),
            config=json.loads(d["config_json"]),
            compensation=json.loads(d["compensation_json"]) if d.get("compensation_json") is not None else None,
        )
        if state.compensation is not None and not isinstance(state.compensation, dict):
            raise TypeError(f"compensation is a {type(state.compensation).__name__}")
    except (KeyError, TypeError, AttributeError, ValueError) as e:
        raise CorruptFileError(f"journal {path} is malformed: {type(e).__name__}: {e}") from None
    if expect_compensation is not None and state.compensation is not None and state.compensation != expect_compensation:
        hint = ""
        if state.compensation.get("method") != expect_compensation.get("method"):
            hint = (" (--error_compensation auto is gptq, in one process and under tensor parallelism; "
                    "older versions resolved it to none under tensor parallelism)")
        elif state.compensation.get("hessians") != expect_compensation.get("hessians"):
            hint = " (the Hessians come from other inputs: other weights or other calibration text)"
        elif state.compensation.get("walk") != expect_compensation.get("walk"):
            hint = " (this version's compensation walk makes other candidates from the same inputs)"
        raise JournalMismatchError(
            f"journal {path} holds gates trained on candidates with {_describe(state.compensation)}; this run's "
            f"candidates have {_describe(expect_compensation)}{hint}: rerun with the journal's compensation, "
            "pass --no_resume to start over, or use another --output_dir"
        )
    if state.config_hash != expect_hash:
        raise JournalMismatchError(
            f"journal {path} was written by a different configuration (hash {state.config_hash} != {expect_hash}); "
            "rerun with the same flags, pass --no_resume to start over, or use another --output_dir"
        )
    if set(state.gates) != expect_names:
        raise CorruptFileError(f"journal {path} holds gates for other tensors than this model's")
    if device is not None:
        state.gates = to_device(state.gates, device)
        state.optimizer = to_device(state.optimizer, device)
    return state


# -- the step log ----------------------------------------------------------------------------

@dataclass
class StepMetrics:
    step: int
    loss: float
    ce: float
    kl: float
    size_penalty: float
    expected_bytes: float
    target_bytes: int
    tau: float
    gate_entropy: float
    tokens_per_s: float
    memory_bytes: int = 0  # peak device memory (CUDA) or peak RSS (CPU) so far
    relaxation_gap: float = 0.0  # predicted KL the mixture hides (--relaxation_gap; 0 when off)

    def to_dict(self) -> dict:
        return dict(self.__dict__)


def read_log(path: Path, upto: int) -> list[StepMetrics]:
    if upto == 0 or not path.exists():
        return []
    out = []
    for line in path.read_text().splitlines():
        try:
            d = json.loads(line)
        except json.JSONDecodeError:
            break
        if d.get("step", 0) <= upto:
            out.append(StepMetrics(**d))
    return out


def append_log(path: Path, m: StepMetrics, *, truncate: bool) -> None:
    # On the first step of a (resumed) run, drop log lines past the journal's step.
    if truncate and path.exists():
        keep = [ln for ln in path.read_text().splitlines() if _step_of(ln) < m.step]
        fileio.write_text(path, "".join(k + "\n" for k in keep))
    with open(path, "a", encoding="utf-8") as f:
        f.write(json.dumps(m.to_dict()) + "\n")


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line).get("step", 1 << 30))
    except (json.JSONDecodeError, AttributeError):
        return 1 << 30
