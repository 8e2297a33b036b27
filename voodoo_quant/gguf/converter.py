"""llama.cpp's own HF → GGUF converter, in-process and as a subprocess.

The converter shipped in the pinned llama.cpp tree (``convert_hf_to_gguf.py`` + its
``conversion/`` package) owns tensor names, metadata, tokenizer and the per-tensor transforms
(permutations, reshapes, head reorders). We never re-implement those: :mod:`voodoo_quant.gguf.layout`
runs its ``modify_tensors`` on index tensors, and export runs the script itself.

The converter must see the *vendored* ``gguf-py`` (it matches the C library exactly; PyPI gguf
0.19 lacks Q2_0 and has a stale Q8_1 size). ``convert_hf_to_gguf.py`` puts it first on sys.path
itself; in-process we load it under the name ``gguf`` while the conversion package imports,
then give ``sys.modules`` back whatever ``gguf`` other code had imported.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
from functools import lru_cache
from pathlib import Path
from types import ModuleType
from typing import Any

from ..core import paths
from ..core.errors import ConfigError, MissingToolError, ToolFailedError

_IMPORT_LOCK = threading.Lock()


def _is_vendored(mod: ModuleType | None) -> bool:
    f = getattr(mod, "__file__", None)
    return bool(f) and Path(f).resolve().is_relative_to(paths.gguf_py_dir().resolve())


@lru_cache(maxsize=1)
def _load() -> tuple[ModuleType, ModuleType]:
    tree = paths.llama_cpp_dir()
    if not (tree / "conversion" / "__init__.py").is_file():
        raise MissingToolError(f"llama.cpp converter package not found under {tree}; run `make bootstrap`")
    with _IMPORT_LOCK:
        saved = {k: v for k, v in sys.modules.items() if k == "gguf" or k.startswith("gguf.")}
        swap = bool(saved) and not _is_vendored(saved.get("gguf"))
        if swap:
            for k in saved:
                del sys.modules[k]
        sys.path.insert(0, str(paths.gguf_py_dir()))
        sys.path.insert(1, str(tree))
        try:
            import gguf  # the vendored one: it is first on sys.path now
            import conversion

            if not _is_vendored(gguf):
                raise MissingToolError(f"could not import the vendored gguf-py from {paths.gguf_py_dir()}")
        finally:
            sys.path.remove(str(paths.gguf_py_dir()))
            sys.path.remove(str(tree))
            if swap:
                for k in [k for k in sys.modules if k == "gguf" or k.startswith("gguf.")]:
                    del sys.modules[k]
                sys.modules.update(saved)
    return gguf, conversion


def vendored_gguf() -> ModuleType:
    """The gguf-py package of the pinned llama.cpp tree (GGUFReader, GGUFWriter, quants)."""
    return _load()[0]


def conversion_package() -> ModuleType:
    return _load()[1]


def read_hparams(model_dir: str | Path) -> dict[str, Any]:
    p = Path(model_dir) / "config.json"
    if not p.is_file():
        raise ConfigError(f"{model_dir} is not an HF checkpoint directory (no config.json)")
    return json.loads(p.read_text(encoding="utf-8"))


def model_class(model_dir: str | Path) -> type:
    """The converter's model class for an HF checkpoint dir, with ``no_mtp`` set on a private
    subclass where the class supports it (a tiny or trained-without-MTP model has none)."""
    conv = conversion_package()
    hparams = conv.ModelBase.load_hparams(Path(model_dir), False)
    arch = conv.get_model_architecture(hparams, conv.ModelType.TEXT)
    try:
        cls = conv.get_model_class(arch)
    except NotImplementedError:
        raise ConfigError(
            f"llama.cpp's converter does not know architecture {arch!r}; it cannot be exported to GGUF"
        ) from None
    if getattr(cls, "supports_mtp_export", False):
        # A private subclass: the converter keeps MTP state in class attributes.
        cls = type(cls.__name__, (cls,), {"model_arch": cls.model_arch, "no_mtp": True})
    return cls


def instantiate(model_dir: str | Path) -> Any:
    """A converter model instance for `model_dir` (tensors indexed lazily, nothing written)."""
    gguf = vendored_gguf()
    cls = model_class(model_dir)
    import torch

    with torch.inference_mode():
        return cls(Path(model_dir), gguf.LlamaFileType.ALL_F32, Path(model_dir) / "unused.gguf", eager=True)


def convert(model_dir: str | Path, outfile: str | Path, *, outtype: str = "f32", extra: tuple[str, ...] = ()) -> Path:
    """Run ``convert_hf_to_gguf.py`` (the stock script) into `outfile`."""
    cmd = [sys.executable, str(paths.convert_script()), str(model_dir), "--outfile", str(outfile), "--outtype", outtype]
    if getattr(model_class(model_dir), "supports_mtp_export", False):
        cmd.append("--no-mtp")
    cmd += list(extra)
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "NO_LOCAL_GGUF": ""}
    env.pop("NO_LOCAL_GGUF")
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if proc.returncode != 0 or not Path(outfile).is_file():
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        raise ToolFailedError(f"convert_hf_to_gguf.py failed on {model_dir} (exit {proc.returncode}): {tail}")
    return Path(outfile)
