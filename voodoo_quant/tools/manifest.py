"""Content-keyed step records of ``voodoo quantize``: skip a step only when its inputs are the same.

Each step of a ladder writes ``<work>/manifests/<step>.json`` after its outputs:

    {"step": ..., "key": ..., "inputs": {...}, "outputs": {path: [size, mtime_ns]}, "seconds": ...}

``key`` is the sha256 of the step's settings and of the keys of the steps it reads from (a chain,
like the candidate cache's content keys: the key of a step changes when anything upstream of it
changes, without hashing large intermediate files again). A step is done when its record exists,
its key equals the key computed now and every recorded output still has its recorded size and
modification time; otherwise it runs again. A ``started`` record is written before a step runs,
so that a step interrupted with other inputs can be told from one to resume (training resumes
from its own journal when the inputs are the same).
"""

from __future__ import annotations

import hashlib
import json
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..core import fileio


def digest(obj: Any) -> str:
    """sha256 of `obj`'s canonical JSON (sorted keys), 24 hex digits."""
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()[:24]


def _stamp(p: Path) -> list[int] | None:
    try:
        st = p.stat()
    except FileNotFoundError:
        return None
    return [st.st_size, st.st_mtime_ns]


@dataclass
class StepRecord:
    step: str
    key: str
    inputs: dict[str, Any] = field(default_factory=dict)
    outputs: dict[str, list[int]] = field(default_factory=dict)
    seconds: float = 0.0
    complete: bool = True


class Manifests:
    """The step records of one ladder, under ``<work>/manifests``."""

    def __init__(self, work: Path):
        self.dir = Path(work) / "manifests"

    def path(self, step: str) -> Path:
        return self.dir / f"{step}.json"

    def load(self, step: str) -> StepRecord | None:
        p = self.path(step)
        if not p.is_file():
            return None
        try:
            d = json.loads(p.read_text(encoding="utf-8"))
            return StepRecord(**d)
        except (json.JSONDecodeError, TypeError, UnicodeDecodeError):
            return None  # a damaged record is no record: the step runs again

    def done(self, step: str, key: str) -> bool:
        r = self.load(step)
        if r is None or not r.complete or r.key != key or not r.outputs:
            return False
        return all(_stamp(Path(p)) == s for p, s in r.outputs.items())

    def started_with_other_inputs(self, step: str, key: str) -> bool:
        """A record (complete or not) exists with another key: the step's old outputs are stale."""
        r = self.load(step)
        return r is not None and r.key != key

    def start(self, step: str, key: str, inputs: dict[str, Any]) -> None:
        fileio.write_json(self.path(step), StepRecord(step, key, inputs, {}, 0.0, False).__dict__)

    def finish(self, step: str, key: str, inputs: dict[str, Any], outputs: Iterable[Path], seconds: float) -> None:
        stamps = {}
        for o in outputs:
            s = _stamp(Path(o))
            if s is None:
                raise FileNotFoundError(f"step {step} did not write {o}")
            stamps[str(o)] = s
        fileio.write_json(self.path(step), StepRecord(step, key, inputs, stamps, round(seconds, 2), True).__dict__)

    def seconds(self) -> dict[str, float]:
        out = {}
        if self.dir.is_dir():
            for p in sorted(self.dir.glob("*.json")):
                r = self.load(p.stem)
                if r is not None and r.complete:
                    out[r.step] = r.seconds
        return out


class Clock:
    def __init__(self) -> None:
        self.t0 = time.perf_counter()

    def __call__(self) -> float:
        return time.perf_counter() - self.t0
