"""Safe file I/O: every output is written atomically, every ``.pt`` is loaded weights-only.

An interrupted write never leaves a partial file under a final name: data goes to a temporary
file in the same directory, is fsync'ed, then renamed over the target (atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from .errors import CorruptFileError, VoodooError


class OutputExistsError(VoodooError):
    exit_code = 2


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it over `target`."""
    target = Path(target)
    if not overwrite and target.exists():
        raise OutputExistsError(f"{target} exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=".tmp", dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        yield tmp_path
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def write_bytes(target: str | os.PathLike, data: bytes, *, overwrite: bool = True) -> Path:
    with atomic_path(target, overwrite=overwrite) as tmp:
        tmp.write_bytes(data)
    return Path(target)


def write_text(target: str | os.PathLike, text: str, *, overwrite: bool = True) -> Path:
    with atomic_path(target, overwrite=overwrite) as tmp:
        tmp.write_text(text, encoding="utf-8")
    return Path(target)


def write_json(target: str | os.PathLike, obj: Any, *, overwrite: bool = True) -> Path:
    return write_text(target, json.dumps(obj, indent=2, sort_keys=False) + "\n", overwrite=overwrite)


def write_with(target: str | os.PathLike, writer: Callable[[Path], None], *, overwrite: bool = True) -> Path:
    """Atomic write through a callback that writes a file at the path it is given."""
    with atomic_path(target, overwrite=overwrite) as tmp:
        writer(tmp)
    return Path(target)


def torch_save(target: str | os.PathLike, obj: Any, *, overwrite: bool = True) -> Path:
    import torch

    return write_with(target, lambda p: torch.save(obj, p), overwrite=overwrite)


def torch_load(path: str | os.PathLike, *, what: str = "checkpoint") -> Any:
    """``torch.load(weights_only=True)``: a pickled payload is refused, never executed."""
    import pickle

    import torch

    path = Path(path)
    if not path.is_file():
        raise CorruptFileError(f"{what} {path} does not exist")
    try:
        return torch.load(path, map_location="cpu", weights_only=True)
    except pickle.UnpicklingError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "unpickling failed"
        raise CorruptFileError(f"{what} {path} is not a plain weights file (refused by weights_only): {first}") from None
    except (RuntimeError, EOFError, ValueError, OSError) as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptFileError(f"{what} {path} is corrupt or truncated: {first}") from None


def read_json(path: str | os.PathLike, *, what: str = "JSON file") -> Any:
    path = Path(path)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise CorruptFileError(f"{what} {path} does not exist") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CorruptFileError(f"{what} {path} is not valid JSON: {e}") from None


def sha256_file(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    import hashlib

    h = hashlib.sha256()
    with open(path, "rb") as f:
        while b := f.read(chunk):
            h.update(b)
    return h.hexdigest()
