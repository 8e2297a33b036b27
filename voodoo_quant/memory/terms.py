"""The lines of a memory plan: a :class:`Term` (what is held, its bytes, a note) and the baseline of
the process that holds them. Below :mod:`.plan` (which adds them up) and :mod:`.phases`."""

from __future__ import annotations

from dataclasses import dataclass

# Resident set of a Python process that has imported torch, transformers and this package
# (measured on this project's CPU machine: bench/memory_model.py prints it).
PROCESS_BASELINE = 0.55e9


@dataclass
class Term:
    name: str
    bytes: float
    note: str = ""
