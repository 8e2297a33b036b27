"""``--device_map dev0,dev1,...``: layer-wise placement inside one process (no collectives).

Contiguous blocks of decoder layers live on the listed devices; everything before the layers sits
on the first, the final norm on the last, a tied LM head with its embedding; every placed module's
tensor inputs follow it by a forward pre-hook. One device computes at a time: this spreads memory,
not work (tensor parallelism, :mod:`voodoo_quant.distributed.parallel`, spreads both).
"""

from __future__ import annotations

from typing import Any, Iterable, Sequence

import torch
import torch.nn as nn
from torch.nn.utils import parametrize

from ..core.errors import ConfigError
from .parallel import decoder_layers


def parse_device_map(spec: str) -> list[str]:
    devs = [d.strip() for d in spec.replace(" ", ",").split(",") if d.strip()]
    if not devs:
        raise ConfigError("--device_map: give at least one device, e.g. cuda:0,cuda:1")
    return devs


def split_layers(n_layers: int, n_devices: int) -> list[int]:
    """Device index of each layer: contiguous blocks, sizes differing by at most one."""
    if n_devices > n_layers:
        raise ConfigError(f"--device_map lists {n_devices} devices for {n_layers} decoder layers")
    base, extra = divmod(n_layers, n_devices)
    out: list[int] = []
    for d in range(n_devices):
        out += [d] * (base + (1 if d < extra else 0))
    return out


def _to(obj: Any, device: torch.device) -> Any:
    if isinstance(obj, torch.Tensor):
        return obj.to(device)
    if isinstance(obj, tuple):
        return tuple(_to(o, device) for o in obj)
    if isinstance(obj, list):
        return [_to(o, device) for o in obj]
    if isinstance(obj, dict):
        return {k: _to(v, device) for k, v in obj.items()}
    return obj


def _follow(mod: nn.Module, device: torch.device) -> None:
    """Move every tensor argument of `mod`'s forward to `device`."""
    mod.register_forward_pre_hook(lambda m, args, kwargs: (_to(args, device), _to(kwargs, device)), with_kwargs=True)


def apply_device_map(model: nn.Module, devices: Sequence[torch.device]) -> list[int]:
    """Place contiguous blocks of decoder layers on `devices` (everything before the layers on
    the first, the final norm on the last, the LM head with its weight) and make inputs follow.
    Returns the device index of each layer."""
    _, layers = decoder_layers(model)
    where = split_layers(len(layers), len(devices))
    model.to(devices[0])
    for layer, d in zip(layers, where):
        layer.to(devices[d])
        _follow(layer, devices[d])
    base = getattr(model, getattr(model, "base_model_prefix", "model"), None)
    norm = getattr(base, "norm", None) if base is not None else None
    if isinstance(norm, nn.Module):
        norm.to(devices[-1])
        _follow(norm, devices[-1])
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    emb = model.get_input_embeddings() if hasattr(model, "get_input_embeddings") else None
    if head is not None:
        tied = _shares_mixed(head, emb) or (emb is not None and not parametrize.is_parametrized(head, "weight")
                                            and head.weight is emb.weight)
        head_dev = devices[0] if tied else devices[-1]  # a tied head stays with the embedding
        head.to(head_dev)
        _follow(head, head_dev)
    return where


def _shares_mixed(a: nn.Module | None, b: nn.Module | None) -> bool:
    if a is None or b is None:
        return False
    if not (parametrize.is_parametrized(a, "weight") and parametrize.is_parametrized(b, "weight")):
        return False
    return a.parametrizations.weight[0] is b.parametrizations.weight[0]


def gate_sum(values: Iterable[torch.Tensor], device: torch.device) -> torch.Tensor:
    """Σ of per-tensor (differentiable) values living on several devices, on `device`."""
    total = None
    for v in values:
        v = v.to(device)
        total = v if total is None else total + v
    return total if total is not None else torch.zeros((), dtype=torch.float64, device=device)

