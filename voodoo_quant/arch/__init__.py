"""Architecture adapters: mostly data (name patterns, tag lists), a hook only where needed.

The core never imports an adapter by name: it asks :func:`adapter_for` with the model's config.
Importing this package registers the shipped adapters.
"""

from .base import ArchAdapter, GenericAdapter, adapter_for, get_adapter, known_adapters, register

__all__ = ["ArchAdapter", "GenericAdapter", "adapter_for", "get_adapter", "known_adapters", "register"]


def _load_shipped() -> None:
    import importlib
    import pkgutil

    for mod in pkgutil.iter_modules(__path__):
        if mod.name not in ("base",) and not mod.name.startswith("_"):
            importlib.import_module(f"{__name__}.{mod.name}")


_load_shipped()
