"""The run's error compensation (``--error_compensation gptq``): the Hessians file reused when made
from the same inputs, else collected, whole (:mod:`.hessians`) or one decoder layer at a time
(:mod:`.layer_hessians`), and the compensations read from it. Above both collections.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn as nn

from ..candidates.compensate import Compensation, compensations
from ..candidates.hessian_store import load_hessians, read_key, write_hessians
from ..candidates.hessian_store import FILE as HESSIANS_FILE
from ..core import fileio
from ..core.errors import ConfigError
from .hessians import collect_passes, hessian_key
from .layer_hessians import collect_layerwise
from .models import reader_of

log = logging.getLogger(__name__)


def ensure(cfg, base: nn.Module, plans: Sequence, tokens: torch.Tensor, *, weights_sha256: str,
           progress: bool = False, device: torch.device | None = None) -> tuple[dict[str, Compensation], dict]:
    """The run's compensations and their provenance record (for the assignment): Hessians reused
    from ``<output_dir>/hessians.safetensors`` when made from the same inputs, else collected and
    written; the Compensations hold mapped views of the file. A loaded `base` is run whole (on its
    own device); a skeleton (``--lazy``) one decoder layer at a time on `device`
    (training/layer_hessians.py): on the CPU the same file."""
    if reader_of(base) is not None and cfg.tensor_parallel > 1:
        raise ConfigError("--error_compensation gptq needs every layer's whole input in one process: "
                          "not under tensor parallelism yet")
    calib = tokens[: cfg.compensation_sequences]
    key = hessian_key(plans, calib, cfg.model, weights_sha256)
    path = cfg.out_dir / HESSIANS_FILE
    if not (path.is_file() and read_key(path) == key):
        if reader_of(base) is not None:
            c = collect_layerwise(base, plans, calib, device=device, progress=progress)
            how = "one decoder layer at a time"
        else:
            c = collect_passes(base, plans, calib, progress=progress)
            how = f"in {c.passes} pass(es)"
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        write_hessians(path, c.sizes, c.shared, key, c.arrays)
        log.info("Hessians of %d tensors (%d stored) from %d sequences %s -> %s",
                 len(c.sizes) + len(c.shared), len(c.sizes), calib.shape[0], how, path)
    hs = load_hessians(path, key=key)
    record = {"method": cfg.compensation, "damp": float(cfg.compensation_damp), "key": key,
              "hessians": str(path.resolve()), "sha256": fileio.sha256_file(path), "tensors": len(hs)}
    return compensations(hs, cfg.compensation_damp), record
