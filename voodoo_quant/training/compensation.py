"""The run's error compensation (``--error_compensation gptq``): the Hessians file reused when made
from the same inputs, else collected one decoder layer at a time in one forward
(:mod:`.layer_hessians`: a skeleton read layer by layer, a loaded model run in place), or, for a
loaded model that road cannot run, whole in passes (:mod:`.hessians`); and the compensations
read from it. Above both collections.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
import torch.nn as nn

from ..candidates.compensate import Compensation, compensations, revision
from ..candidates.hessian_store import load_hessians, read_key, write_hessians
from ..candidates.hessian_store import FILE as HESSIANS_FILE
from ..core import fileio
from .hessians import collect_passes, hessian_key
from .layer_hessians import LayerwiseUnsupported, collect_layerwise
from .models import reader_of

log = logging.getLogger(__name__)


def ensure(cfg, base: nn.Module, plans: Sequence, tokens: torch.Tensor, *, weights_sha256: str,
           progress: bool = False, device: torch.device | None = None, tp=None) -> tuple[dict[str, Compensation], dict]:
    """The run's compensations and their provenance record (for the assignment): Hessians reused
    from ``<output_dir>/hessians.safetensors`` when made from the same inputs, else collected and
    written; the Compensations hold mapped views of the file. Both kinds of `base` are run one
    decoder layer at a time, in one forward over the text (training/layer_hessians.py): a loaded
    one in place, on its own device; a skeleton (``--lazy``, tensor parallelism) read layer by
    layer onto `device`. On the CPU either gives the whole-model collection's file.

    Under tensor parallelism (`tp`) rank 0 alone collects and writes the file, on its skeleton and
    its device, while the others wait; every rank then maps it. So every tensor, column- or
    row-parallel, is compensated with the Hessian of its whole input, as in one process: rank 0
    runs each decoder layer whole, where a rank of the split model would see only its shard of a
    row-parallel layer's input (the block-diagonal part of H; bench/tp_compensation.py measures
    what that approximation would cost). The candidates are built by rank 0 from whole tensors
    (training/setup.py), so a rank's shard of a candidate is the shard of the one-process bytes."""
    calib = tokens[: cfg.compensation_sequences]
    key = hessian_key(plans, calib, cfg.model, weights_sha256)
    path = cfg.out_dir / HESSIANS_FILE
    main = tp is None or tp.is_main
    if tp is not None and not main:
        tp.barrier()  # rank 0 collects (or finds) the file
    try:
        if main:
            write_if_missing(path, key, base, plans, calib, device=device, progress=progress)
    finally:
        if tp is not None and main:
            tp.barrier()
    hs = load_hessians(path, key=key)
    record = None
    if main:
        record = {"method": cfg.compensation, "damp": float(cfg.compensation_damp), "sweep": cfg.compensation_sweep,
                  "key": key, "hessians": str(path.resolve()), "sha256": fileio.sha256_file(path), "tensors": len(hs)}
        walk = revision(cfg.compensation_sweep)
        if walk is not None:  # what the sweep's walk does beyond its name (candidates/compensate.revision)
            record["walk"] = walk
    if tp is not None:  # one hash of a file that may be tens of GB, not one per rank
        record = tp.all_gather_object(record)[0]
    return compensations(hs, cfg.compensation_damp, cfg.compensation_sweep), record


def write_if_missing(path, key: str, base: nn.Module, plans: Sequence, calib: torch.Tensor, *,
                     device: torch.device | None = None, progress: bool = False) -> bool:
    """Collect the Hessians of `plans` on `calib` into `path` unless it already holds those of
    `key`; True when it collected. One decoder layer at a time, in one forward over `calib`: a
    skeleton `base` read onto `device`, a loaded one run in place on its own device. A loaded
    model that road refuses (no ModuleList of decoder layers, layers that do not return the
    hidden states, ...) is collected whole, in as many forwards as ``VOODOO_HESSIAN_PASS_GB``
    takes: the same file, on the CPU."""
    if path.is_file() and read_key(path) == key:
        return False
    path.parent.mkdir(parents=True, exist_ok=True)
    skeleton = reader_of(base) is not None
    try:
        c = collect_layerwise(base, plans, calib, device=device if skeleton else None, progress=progress)
        write_hessians(path, c.sizes, c.shared, key, c.arrays)  # atomic: a refusal on the way leaves no file
        how = (f"one decoder layer at a time ({'read from the checkpoint' if skeleton else 'the loaded model in place'}), "
               f"{c.passes} forward(s) over the text")
    except LayerwiseUnsupported as e:
        if skeleton:
            raise
        log.info("Hessians: not layer by layer (%s): the whole model instead", e.why)
        c = collect_passes(base, plans, calib, progress=progress)
        write_hessians(path, c.sizes, c.shared, key, c.arrays)
        how = f"the whole model, {c.passes} forward(s) over the text (VOODOO_HESSIAN_PASS_GB)"
    log.info("Hessians of %d tensors (%d stored) from %d sequences, %s -> %s",
             len(c.sizes) + len(c.shared), len(c.sizes), calib.shape[0], how, path)
    return True
