"""voodoo_quant: learn a per-tensor llama.cpp quant type under a size budget, export a stock GGUF.

``from voodoo_quant import VoodooQuantizer, VoodooConfig`` gives the notebook facade
(:mod:`voodoo_quant.api`). The names are resolved lazily (PEP 562), so ``import voodoo_quant``
stays cheap: it imports neither torch nor transformers.
"""

from __future__ import annotations

_LAZY = {"VoodooQuantizer": "api", "VoodooConfig": "api", "QuantizedModel": "api"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    mod = _LAZY.get(name)
    if mod is None:
        raise AttributeError(f"module 'voodoo_quant' has no attribute {name!r}")
    from importlib import import_module

    value = getattr(import_module(f"{__name__}.{mod}"), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_LAZY))
