"""The assignment's record of what each tensor got (``selection.assignment.TensorChoice``), made
by the trainer after the bake: its type and bytes, the gate probability of a menu type, the sha256
of the candidate bytes the run measured (export checks its bytes against it) and whether those
bytes are error-compensated."""

from __future__ import annotations

from typing import Mapping

import torch

from ..selection.assignment import TensorChoice
from .setup import RunSetup, candidate_is_compensated


def tensor_choices(run: RunSetup, types: Mapping[str, str], sizes: Mapping[str, int],
                   probs: Mapping[str, torch.Tensor]) -> dict[str, TensorChoice]:
    """The assignment's record of each tensor written at `types`: its bytes, the gate probability of
    a menu type, the sha256 of the candidate bytes the run measured, and whether they are
    compensated (a reference's off-menu type is plain: ``setup.candidate_is_compensated``)."""
    out = {}
    for p in run.plans:
        t = types[p.name]
        conf = round(float(probs[p.name][p.menu.types.index(t)]), 6) if t in p.menu.types else None
        out[p.name] = TensorChoice(
            name=p.name, qtype=t, shape=p.shape, nbytes=sizes[p.name], gguf_name=p.gguf_name,
            confidence=conf, menu=p.menu.types, sha256=run.candidate_sha256.get((p.name, t)),
            compensated=candidate_is_compensated(p, t, run.compensated),
        )
    return out
