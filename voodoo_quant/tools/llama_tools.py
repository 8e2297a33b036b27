"""Running llama.cpp's stock tools (llama-perplexity, llama-quantize, ...) as subprocesses.

Arguments are always a list (never a shell string). A missing tool raises MissingToolError; a
failing one raises ToolFailedError carrying the tool's last meaningful stderr line.
"""

from __future__ import annotations

import math
import os
import subprocess
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

from ..core import paths
from ..core.errors import CorruptFileError, ToolFailedError
from ..gguf.header import read_file, tensor_nbytes


@dataclass(frozen=True)
class ToolRun:
    args: list[str]
    returncode: int
    stdout: str
    stderr: str

    @property
    def output(self) -> str:
        return self.stdout + "\n" + self.stderr


def last_error_line(text: str) -> str:
    """The most telling line of a tool's stderr: the last one that mentions an error, else the last."""
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    for ln in reversed(lines):
        if "error" in ln.lower() or "failed" in ln.lower():
            return ln
    return lines[-1] if lines else "(no output)"


def run_tool(name: str, args: Sequence[str | os.PathLike], *, timeout: float | None = None,
             cwd: str | os.PathLike | None = None) -> ToolRun:
    exe = paths.tool_path(name)  # MissingToolError with the build hint
    argv = [str(exe), *map(str, args)]
    env = dict(os.environ, GGML_NO_BACKTRACE="1")  # a failing ggml check must not start gdb
    try:
        p = subprocess.run(argv, capture_output=True, text=True, errors="replace", timeout=timeout,
                           cwd=cwd, env=env)
    except subprocess.TimeoutExpired:
        raise ToolFailedError(f"{name} did not finish within {timeout:.0f} s") from None
    except OSError as e:
        raise ToolFailedError(f"{name} could not start: {e}") from None
    run = ToolRun(argv, p.returncode, p.stdout, p.stderr)
    if p.returncode != 0:
        raise ToolFailedError(f"{name} exited with {p.returncode}: {last_error_line(p.stderr or p.stdout)}")
    return run


def tool_exists(name: str) -> bool:
    return (paths.llama_cpp_dir() / "build" / "bin" / name).is_file()


def gguf_tensor_stats(path: str | Path) -> tuple[int, int]:
    """(tensor data bytes, weights) of a GGUF file, from its header (:func:`check_gguf`'s reader and
    the project's type table: a second of pure Python on a 150k-token vocabulary where gguf-py's
    reader takes ten)."""
    tensors = _tensors(Path(path), "GGUF file")
    return sum(t[2] for t in tensors), sum(t[1] for t in tensors)


def check_gguf(path: str | Path, what: str = "GGUF file") -> None:
    """Parse a GGUF's header (magic, version, key/values, tensor infos, types) and check that every
    tensor's data lies inside the file, before the file is handed to a stock tool, which on a bad
    file may exit with no message naming it. Reads only the header (grown until it parses)."""
    _tensors(Path(path), what)


def _tensors(path: Path, what: str) -> list[tuple[str, int, int, int]]:
    """(name, weights, data bytes, data offset) of every tensor of a GGUF, checked as
    :func:`check_gguf` says (``gguf.header.read_file``)."""
    _, infos, data0 = read_file(path, what)
    if not infos:
        raise CorruptFileError(f"{what} {path} holds no tensors")
    return [(name, math.prod(ne), tensor_nbytes(ne, gtype), data0 + off) for name, ne, gtype, off in infos]
