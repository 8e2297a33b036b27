"""Safe file I/O: every output is written atomically, every ``.pt`` is loaded weights-only.

An interrupted write never leaves a partial file under a final name: data goes to a temporary
file in the same directory, is fsync'ed, then renamed over the target (atomic on POSIX).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

from . import faults
from .errors import ConfigError, CorruptFileError, VoodooError

TMP_SUFFIX = ".tmp"


class OutputExistsError(VoodooError):
    exit_code = 2


class DiskSpaceError(ConfigError):
    """Not enough free space for the outputs a run is about to write (checked up front)."""


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


@contextlib.contextmanager
def atomic_path(target: str | os.PathLike, *, overwrite: bool = True) -> Iterator[Path]:
    """Yield a temporary path beside `target`; on success rename it over `target`."""
    target = Path(target)
    if not overwrite and target.exists():
        raise OutputExistsError(f"{target} exists; pass --overwrite to replace it")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent)
    os.close(fd)
    tmp_path = Path(tmp)
    try:
        # mkstemp creates 0600; the final file gets the mode an ordinary open() would give it.
        os.chmod(tmp_path, 0o666 & ~_umask())
        yield tmp_path
        faults.hit("write:" + target.name)  # tests: killed with the data written, not yet renamed
        with open(tmp_path, "rb+") as f:
            os.fsync(f.fileno())
        os.replace(tmp_path, target)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            tmp_path.unlink()
        raise


def remove_stale_temps(directory: str | os.PathLike, names: list[str] | tuple[str, ...] = ()) -> list[Path]:
    """Delete the temporaries ``.<name>.XXXX.tmp`` that atomic writes of the final files `names`
    left in `directory` when killed before their rename (never a final name). Call it only where
    no other process is writing those names."""
    directory = Path(directory)
    gone = []
    if directory.is_dir():
        for p in (q for n in names for q in directory.glob(f".{glob_escape(n)}.*{TMP_SUFFIX}")):
            if p.is_file():
                with contextlib.suppress(FileNotFoundError):
                    p.unlink()
                    gone.append(p)
    return gone


def glob_escape(name: str) -> str:
    import glob

    return glob.escape(name)


def ensure_writable(directory: str | os.PathLike, *, flag: str = "--output_dir") -> Path:
    """Create `directory` and prove a file can be written there, before any long work."""
    directory = Path(directory)
    try:
        directory.mkdir(parents=True, exist_ok=True)
        fd, probe = tempfile.mkstemp(prefix=".write-probe.", suffix=TMP_SUFFIX, dir=directory)
        os.close(fd)
        os.unlink(probe)
    except OSError as e:
        raise ConfigError(f"{flag} {directory} is not writable: {e.strerror or e}") from None
    return directory


def ensure_free_space(directory: str | os.PathLike, need_bytes: int, *, what: str) -> None:
    """Refuse to start when the file system of `directory` has less free space than `need_bytes`
    (the outputs about to be written there), rather than fail after hours of work."""
    directory = Path(directory)
    probe = directory
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if need_bytes > free:
        raise DiskSpaceError(
            f"not enough free space for {what} in {directory}: needs {need_bytes / 1e6:,.1f} MB, "
            f"{free / 1e6:,.1f} MB free"
        )


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


def write_dir(target: str | os.PathLike, writer: Callable[[Path], None]) -> Path:
    """Atomic directory: `writer` fills a temporary directory beside `target`
    (``.<name>.XXXX.tmp``), which is renamed to `target` once it returns. A killed or failed
    write leaves no `target`, only a temporary that nothing takes for it. `target` must not exist."""
    target = Path(target)
    if target.exists():
        raise OutputExistsError(f"{target} exists; remove it or choose another path")
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=TMP_SUFFIX, dir=target.parent))
    try:
        os.chmod(tmp, 0o777 & ~_umask())  # mkdtemp creates 0700; the mode an ordinary mkdir gives
        writer(tmp)
        faults.hit("write:" + target.name)  # tests: killed with the directory written, not yet renamed
        os.rename(tmp, target)  # atomic; fails rather than merge if `target` appeared meanwhile
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return target


def copy_file(source: str | os.PathLike, target: str | os.PathLike, *, overwrite: bool = True) -> Path:
    """Copy `source` to `target` atomically, streamed (never whole in memory)."""
    return write_with(target, lambda tmp: shutil.copyfile(source, tmp), overwrite=overwrite)


def link_or_copy(source: str | os.PathLike, target: str | os.PathLike) -> Path:
    """Give `target` the contents of `source` without a second copy on disk where the file system
    allows: a hard link, made under a temporary name and renamed over `target` (atomic). Where it
    does not (another file system, or one without hard links), a streamed copy, as atomic.

    Safe because this module never writes a file in place: every write renames a new file over
    the old path, so a later write to either name leaves the other's contents as they were."""
    source, target = Path(source), Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = target.parent / f".{target.name}.{os.getpid()}.link{TMP_SUFFIX}"
    try:
        tmp.unlink(missing_ok=True)
        os.link(source, tmp)
    except OSError:  # EXDEV, EPERM, ENOTSUP...: no hard link here
        tmp.unlink(missing_ok=True)
        return copy_file(source, target)
    try:
        os.replace(tmp, target)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    return target


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
    except Exception as e:  # noqa: BLE001
        # A damaged zip/pickle stream makes torch's weights-only unpickler raise whatever it hits
        # (IndexError, KeyError, struct.error, ... found by tests/test_fuzz_readers.py); the file
        # is the cause in every case.
        first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
        raise CorruptFileError(f"{what} {path} is corrupt or truncated: {type(e).__name__}: {first}") from None


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
