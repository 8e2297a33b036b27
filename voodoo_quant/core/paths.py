"""Where things live on disk: the repository, the llama.cpp build, its tools and libggml-base.

Lookups only; the bootstrap (``scripts/bootstrap-llama.sh``) is what builds them.
"""

from __future__ import annotations

import sys
from pathlib import Path

from . import envs
from .errors import GGMLLibraryError, MissingToolError

PACKAGE_DIR = Path(__file__).resolve().parents[1]  # this file is voodoo_quant/core/paths.py
REPO_ROOT = PACKAGE_DIR.parent

STOCK_TOOLS = ("llama-quantize", "llama-perplexity", "llama-imatrix", "llama-completion")

_LIB_NAMES = {
    "linux": ("libggml-base.so",),
    "darwin": ("libggml-base.dylib",),
    "win32": ("ggml-base.dll",),
}


def llama_cpp_dir() -> Path:
    """The llama.cpp tree: ``VOODOO_LLAMA_CPP_DIR``, else ``third_party/llama.cpp`` of the repo."""
    return envs.llama_cpp_dir() or REPO_ROOT / "third_party" / "llama.cpp"


def _lib_names() -> tuple[str, ...]:
    return _LIB_NAMES.get(sys.platform, _LIB_NAMES["linux"])


def ggml_lib_candidates() -> list[Path]:
    build = llama_cpp_dir() / "build"
    return [d / n for d in (build / "bin", build / "ggml" / "src", build) for n in _lib_names()]


def ggml_lib_path() -> Path:
    """libggml-base: ``VOODOO_GGML_LIB`` if set (must exist), else the bootstrap build."""
    explicit = envs.ggml_lib()
    if explicit is not None:
        if not explicit.is_file():
            raise GGMLLibraryError(f"VOODOO_GGML_LIB={explicit} does not exist")
        return explicit
    for cand in ggml_lib_candidates():
        if cand.is_file():
            return cand
    raise GGMLLibraryError(
        f"libggml-base not found under {llama_cpp_dir() / 'build'}; run `make bootstrap` "
        "or set VOODOO_GGML_LIB to its path"
    )


def tool_path(name: str) -> Path:
    """Path of a stock llama.cpp tool, or MissingToolError saying how to build it."""
    p = llama_cpp_dir() / "build" / "bin" / name
    if not p.is_file():
        raise MissingToolError(f"{name} not found at {p}; run `make bootstrap` to build llama.cpp's tools")
    return p


def convert_script() -> Path:
    p = llama_cpp_dir() / "convert_hf_to_gguf.py"
    if not p.is_file():
        raise MissingToolError(f"convert_hf_to_gguf.py not found at {p}; run `make bootstrap`")
    return p


def gguf_py_dir() -> Path:
    """The gguf-py package vendored by the pinned llama.cpp (matches the C library exactly)."""
    return llama_cpp_dir() / "gguf-py"
