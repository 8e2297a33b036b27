"""Layer-input Hessians for ``--error_compensation gptq`` (voodoo_quant/compensate.py).

H = Σ xᵀx over the inputs x of every planned Linear, on the first ``--compensation_sequences``
training sequences, from the float model before the gates replace its weights. Tensors that read
the same input (q/k/v, gate/up) share one accumulator. A tied embedding is compensated as the LM
head it also is: its H is the head's input (the final hidden states), where its rounding error
reaches every logit; the lookup's share of the error is left unweighted. Each H is stored in the GGUF tensor's
column order, keyed by the HF tensor name, in ``<output_dir>/hessians.pt``; a later run (or size
of a ladder) with the same inputs reuses it, and export reads it, checked by its sha256.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn

from .. import fileio
from ..compensate import HESSIANS_FILE, compensations, load_hessians, save_hessians
from ..compensate import Compensation  # noqa: F401  (re-exported for callers of ensure)
from ..errors import ConfigError

log = logging.getLogger(__name__)


def gguf_columns(layout) -> tuple[bool, np.ndarray | None]:
    """(whether the GGUF matrix's columns are the HF weight's input features, in which order: None
    = the same). False for a transposed, reshaped or generally permuted tensor."""
    inner = getattr(layout, "inner", None)
    if inner is None:  # IdentityLayout
        shape = tuple(getattr(layout, "shape", ()))
        return len(shape) == 2, None
    if inner.gather is not None or inner.transposed or len(inner.hf_shape) != 2:
        return False, None
    return True, None if inner.cols is None else np.asarray(inner.cols, dtype=np.int64)


def reader(plan, modules: dict[str, nn.Module]) -> str | None:
    """The module whose input the plan's Hessian is taken from: its one Linear, the other modules
    (if any) being lookups of the same rows (a tied embedding's Embedding beside its LM head)."""
    linear = [m for m in plan.modules if isinstance(modules.get(m), nn.Linear)]
    lookups = [m for m in plan.modules if isinstance(modules.get(m), nn.Embedding)]
    return linear[0] if len(linear) == 1 and len(linear) + len(lookups) == len(plan.modules) else None


def compensable(plan, modules: dict[str, nn.Module]) -> bool:
    """A plan read by one Linear (see :func:`reader`) whose input features are the GGUF rows' columns."""
    name = reader(plan, modules)
    if name is None:
        return False
    ok, _ = gguf_columns(plan.layout)
    return ok and modules[name].in_features == plan.layout.n_per_row


def collect(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, batch_size: int = 4,
            progress: bool = False) -> dict[str, np.ndarray]:
    """HF name → float32 Hessian of its input (GGUF column order) for every compensable plan."""
    modules = dict(model.named_modules())
    chosen = [p for p in plans if compensable(p, modules)]
    if not chosen:
        return {}
    device = next(model.parameters()).device
    owner = _shared_inputs(model, chosen, modules, tokens[:1, :8].to(device))
    acc: dict[str, torch.Tensor] = {}
    hooks = []

    def hook_for(name: str):
        def hook(mod, inp, out):
            x2 = inp[0].detach().reshape(-1, inp[0].shape[-1]).to(torch.float32)
            h = x2.T @ x2
            acc[name] = h if name not in acc else acc[name].add_(h)
        return hook

    for p in chosen:
        if owner[p.name] == p.name:
            hooks.append(modules[reader(p, modules)].register_forward_hook(hook_for(p.name)))
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            it = range(0, tokens.shape[0], batch_size)
            if progress:
                from rich.progress import track

                it = track(it, description="Hessians", transient=True)
            for i in it:
                model(tokens[i:i + batch_size].to(device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    arrays = {k: np.ascontiguousarray(v.cpu().numpy(), dtype=np.float32) for k, v in acc.items()}
    out = {}
    for p in chosen:
        src = owner[p.name]
        if src not in arrays:
            continue  # never reached on this text (e.g. an unused expert)
        _, cols = gguf_columns(p.layout)
        # one array per shared input (the Hessians file stores it once); a column permutation its own
        out[p.name] = arrays[src] if cols is None else np.ascontiguousarray(arrays[src][np.ix_(cols, cols)])
    return out


def _shared_inputs(model: nn.Module, chosen: Sequence, modules: dict[str, nn.Module], probe: torch.Tensor) -> dict[str, str]:
    """plan → the first plan that reads the very same input tensor (q/k/v, gate/up share one):
    found on a short probe forward that keeps every input alive, so no address is reused."""
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(mod, inp, out) -> None:  # returns None: a forward hook's value would replace the output
            inputs.setdefault(name, inp[0])
        return hook

    hooks = [modules[reader(p, modules)].register_forward_hook(keep(p.name)) for p in chosen]
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for h in hooks:
            h.remove()
    owner: dict[str, str] = {}
    leaders: list[tuple[str, torch.Tensor | None]] = []
    for p in chosen:
        x = inputs.get(p.name)
        lead = next((n for n, y in leaders if x is not None and y is x), None)
        if lead is None:
            leaders.append((p.name, x))
            lead = p.name
        owner[p.name] = lead
    return owner


# what `collect` measures; a file from an older collection (before the tied embedding was read at
# the LM head) is collected again rather than reused without it
COLLECTION = "inputs/2"


def hessian_key(plans: Sequence, tokens: torch.Tensor, model: str, weights_sha256: str) -> str:
    h = hashlib.sha256(COLLECTION.encode())
    h.update(json.dumps(sorted(p.name for p in plans)).encode())
    h.update(str(model).encode())
    h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
    h.update(weights_sha256.encode())
    return h.hexdigest()[:16]


def ensure(cfg, base: nn.Module, plans: Sequence, tokens: torch.Tensor, *, weights_sha256: str,
           progress: bool = False) -> tuple[dict[str, Compensation], dict]:
    """The run's compensations and their provenance record (for the assignment): Hessians reused
    from ``<output_dir>/hessians.pt`` when made from the same inputs, else collected and saved."""
    from .models import reader_of

    if reader_of(base) is not None:
        raise ConfigError("--error_compensation gptq reads the whole float model: not with --lazy or a "
                          "tensor-parallel skeleton yet")
    calib = tokens[: cfg.compensation_sequences]
    key = hessian_key(plans, calib, cfg.model, weights_sha256)
    path = cfg.out_dir / HESSIANS_FILE
    hs = load_hessians(path, key=key) if path.exists() else None
    if hs is None:
        hs = collect(base, plans, calib, progress=progress)
        cfg.out_dir.mkdir(parents=True, exist_ok=True)
        save_hessians(path, hs, key)
        log.info("Hessians of %d tensors from %d sequences -> %s", len(hs), calib.shape[0], path)
    record = {"method": cfg.error_compensation, "damp": float(cfg.compensation_damp),
              "hessians": str(path.resolve()), "sha256": fileio.sha256_file(path), "tensors": len(hs)}
    return compensations(hs, cfg.compensation_damp), record
