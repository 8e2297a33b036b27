"""``ArchAdapter`` and its registry.

An adapter describes one model family to the core:

- ``model_types``: the ``config.model_type`` values it serves (lookup key);
- ``attention_segments``: substrings of a parameter name that put a tensor in the attention
  family (it then takes ``--attention_candidates``);
- ``gguf_name(hf_name)``: the llama.cpp tensor name of an HF parameter (export, imatrix,
  tensor-type file);
- ``shard_layer``: tensor-parallel sharding of one decoder layer (None = TP refused).
"""

from __future__ import annotations

import re
from typing import Any, ClassVar

from ..core.errors import ConfigError
from ..distributed.parallel import Shard


class UnknownArchitectureError(ConfigError):
    pass


class ArchAdapter:
    name: ClassVar[str] = "generic"
    model_types: ClassVar[tuple[str, ...]] = ()
    # HF parameter-name substrings that mark the attention family.
    attention_segments: ClassVar[tuple[str, ...]] = ("self_attn.", "attention.", "attn.")
    # No layout flags here: how the converter lays a tensor out in the GGUF (transposed, rows or
    # columns permuted) is learned from the converter itself (layout.py), for every architecture.
    # (regex on the HF name, GGUF name template with {bid}) pairs; first match wins.
    gguf_names: ClassVar[tuple[tuple[str, str], ...]] = ()

    def __init__(self, config: Any = None):
        self.config = config

    def is_attention(self, hf_name: str) -> bool:
        return any(seg in hf_name for seg in self.attention_segments)

    def gguf_name(self, hf_name: str) -> str | None:
        for pattern, template in self.gguf_names:
            m = re.fullmatch(pattern, hf_name)
            if m:
                return template.format(**m.groupdict())
        return None

    # Tensor parallelism: adapters that support it define
    #   shard_layer(self, layer: nn.Module, world: int) -> voodoo_quant.distributed.parallel.LayerShard
    # (the split of every parameter of one decoder layer, names relative to the layer).
    shard_layer = None

    @property
    def supports_tp(self) -> bool:
        return self.shard_layer is not None


def attention_shards(attn: Any, prefix: str, *, out_name: str = "o_proj", q_unit_factor: int = 1):
    """Heads of a (grouped-query) attention block split across ranks: q/k/v by whole heads
    (column-parallel, biases with them), the output projection by the same head columns
    (row-parallel). `q_unit_factor` = 2 where q_proj interleaves a gate per head (Qwen3.5)."""
    hd = attn.head_dim
    out = {}
    for name, unit in (("q_proj", hd * q_unit_factor), ("k_proj", hd), ("v_proj", hd)):
        lin = getattr(attn, name)
        out[f"{prefix}{name}.weight"] = Shard.rows(lin.weight.shape[0], unit)
        if getattr(lin, "bias", None) is not None:
            out[f"{prefix}{name}.bias"] = Shard.rows(lin.bias.shape[0], unit)
    o = getattr(attn, out_name)
    out[f"{prefix}{out_name}.weight"] = Shard.cols(o.weight.shape[1], hd)
    return out


def mlp_shards(mlp: Any, prefix: str, *, gate: str = "gate_proj", up: str = "up_proj", down: str = "down_proj"):
    """A gated MLP split by its intermediate features: gate/up column-, down row-parallel."""
    out = {}
    for name in (gate, up):
        lin = getattr(mlp, name)
        out[f"{prefix}{name}.weight"] = Shard.rows(lin.weight.shape[0])
        if getattr(lin, "bias", None) is not None:
            out[f"{prefix}{name}.bias"] = Shard.rows(lin.bias.shape[0])
    out[f"{prefix}{down}.weight"] = Shard.cols(getattr(mlp, down).weight.shape[1])
    return out


class GenericAdapter(ArchAdapter):
    """Rules for a model without a registered adapter: single-device training works for any
    model transformers loads; attention is recognized by the usual module names."""


_REGISTRY: dict[str, type[ArchAdapter]] = {}


def register(cls: type[ArchAdapter]) -> type[ArchAdapter]:
    """Class decorator: register an adapter for its ``model_types``; duplicates are refused."""
    if not cls.model_types:
        raise ValueError(f"adapter {cls.__name__} declares no model_types")
    for mt in cls.model_types:
        if mt in _REGISTRY and _REGISTRY[mt] is not cls:
            raise ValueError(f"model_type {mt!r} already has adapter {_REGISTRY[mt].__name__}; refusing {cls.__name__}")
        _REGISTRY[mt] = cls
    return cls


def known_adapters() -> dict[str, type[ArchAdapter]]:
    return dict(sorted(_REGISTRY.items()))


def get_adapter(model_type: str, config: Any = None) -> ArchAdapter:
    """The registered adapter for `model_type`, or an error listing the known ones."""
    cls = _REGISTRY.get(model_type)
    if cls is None:
        raise UnknownArchitectureError(
            f"no architecture adapter for model_type {model_type!r}; known: {', '.join(_REGISTRY) or 'none'}"
        )
    return cls(config)


def adapter_for(config: Any) -> ArchAdapter:
    """The adapter for an HF config, falling back to :class:`GenericAdapter`."""
    model_type = getattr(config, "model_type", None)
    cls = _REGISTRY.get(model_type or "")
    return cls(config) if cls else GenericAdapter(config)
