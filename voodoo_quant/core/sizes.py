"""File sizes as a user writes them: ``1.2GB``, ``800MiB``, ``123456`` (bytes).

Decimal units are powers of 1000 (``KB``, ``MB``, ``GB``, ``TB``; ``K``/``M``/``G``/``T`` too),
binary ones powers of 1024 (``KiB``, ``MiB``, ``GiB``, ``TiB``), as file managers and Hugging Face
show sizes; a bare number is bytes. ``B`` may follow or not; case does not matter.
"""

from __future__ import annotations

import re

from .errors import ConfigError

_UNITS = {"": 1, "k": 1000, "m": 1000 ** 2, "g": 1000 ** 3, "t": 1000 ** 4,
          "ki": 1024, "mi": 1024 ** 2, "gi": 1024 ** 3, "ti": 1024 ** 4}
_RE = re.compile(r"\s*([0-9]*\.?[0-9]+(?:[eE][0-9]+)?)\s*([kmgt]i?)?b?\s*", re.IGNORECASE)


def parse_size(text: str | int, flag: str = "size") -> int:
    """Bytes of `text` (see the module doc); a ConfigError names `flag` when it is not a size."""
    if isinstance(text, bool):
        raise ConfigError(f"{flag}: {text!r} is not a size")
    if isinstance(text, int):
        n = text
    else:
        m = _RE.fullmatch(str(text))
        if m is None:
            raise ConfigError(f"{flag}: {text!r} is not a size (e.g. 1.2GB, 800MiB, or a number of bytes)")
        n = int(float(m.group(1)) * _UNITS[(m.group(2) or "").lower()])
    if n <= 0:
        raise ConfigError(f"{flag} must be a positive size, got {text!r}")
    return n


def format_size(n: int) -> str:
    """``1.23 GB`` (decimal, as :func:`parse_size` reads it back within the rounding)."""
    for unit, f in (("TB", 1000 ** 4), ("GB", 1000 ** 3), ("MB", 1000 ** 2), ("KB", 1000)):
        if n >= f:
            return f"{n / f:.2f} {unit}"
    return f"{n} B"
