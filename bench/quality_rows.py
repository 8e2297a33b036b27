"""The quality benchmark's result files: JSON lines in the repository, appended atomically.

One line per (file, eval text) in ``<name>.jsonl`` and one per ladder step that ran in
``<name>.cost.jsonl`` (its wall time and the process's peak RSS so far). A line is added by
rewriting the whole file into a temporary file renamed over it (``fileio``): a killed run leaves
the file as it was before the line or after it, never half a line. Only one run may write a
results file at a time.

Every result line carries ``digest``: the sha256 of the settings that made it (the model's and the
texts' content hashes, the recipe or method, size, steps, seed, the eval's context and chunks,
the pinned llama.cpp). The code's own commit is recorded beside it (``versions``), not in it, so
that each session's commit of the results does not invalidate the rows before it.
"""

from __future__ import annotations

import json
import os
import resource
import subprocess
from pathlib import Path
from typing import Any, Iterable

ROOT = Path(__file__).resolve().parents[1]


def read_rows(path: Path) -> list[dict[str, Any]]:
    """The lines of a JSONL file (none when it does not exist); a line that does not parse is an
    error naming the file and line (a results file is edited by git merges, not by hand)."""
    path = Path(path)
    if not path.is_file():
        return []
    out = []
    for i, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if line.strip():
            try:
                out.append(json.loads(line))
            except json.JSONDecodeError as e:
                raise ValueError(f"{path}:{i} is not a JSON line: {e.msg}") from None
    return out


def append_rows(path: Path, rows: Iterable[dict[str, Any]]) -> None:
    from voodoo_quant.core import fileio

    new = "".join(json.dumps(r, sort_keys=True, ensure_ascii=False) + "\n" for r in rows)
    if not new:
        return
    path = Path(path)
    old = path.read_text(encoding="utf-8") if path.is_file() else ""
    if old and not old.endswith("\n"):
        old += "\n"
    fileio.write_text(path, old + new)


def cost_path(results: Path) -> Path:
    """``<name>.cost.jsonl`` beside ``<name>.jsonl``."""
    results = Path(results)
    return results.with_name(results.name.removesuffix(".jsonl") + ".cost.jsonl")


def llama_cpp_commit() -> str:
    """The pinned llama.cpp commit (scripts/llama_cpp.pin): what built the stock tools."""
    for line in (ROOT / "scripts" / "llama_cpp.pin").read_text().splitlines():
        if line.startswith("LLAMA_CPP_COMMIT="):
            return line.split("=", 1)[1].strip()
    raise ValueError("scripts/llama_cpp.pin names no LLAMA_CPP_COMMIT")


def code_commit() -> str:
    """This checkout's commit, with ``-dirty`` when tracked files differ from it."""
    def git(*args: str) -> str:
        return subprocess.run(["git", "-C", str(ROOT), *args], capture_output=True, text=True).stdout.strip()

    head = git("rev-parse", "HEAD") or "unknown"
    return head + ("-dirty" if git("status", "--porcelain", "--untracked-files=no") else "")


def peak_rss_mb() -> dict[str, float]:
    """Peak resident memory so far: this process (``self``) and the largest finished child
    process (``children``: llama-quantize, llama-perplexity), in MB (Linux reports KiB)."""
    scale = 1 / 1024 if os.uname().sysname != "Darwin" else 1 / (1 << 20)
    return {"self": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * scale, 1),
            "children": round(resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * scale, 1)}
