"""The quality benchmark's texts: two domains, each split by file into calibration and held-out parts.

- ``plays``: the embedded Shakespeare plays (``voodoo_quant.tools.embedded.shakespeare_dir``), ``*.md``;
- ``python``: the Python standard library's own sources (``sysconfig.get_paths()["stdlib"]``),
  ``*.py``, without its test suites, its generated tables (``encodings``, ``pydoc_data``) and
  ``site-packages`` (third-party code differs from machine to machine); UTF-8 files only.

A domain's files are sorted by relative path, deduplicated by content (the first path of identical
files stays), shuffled with a fixed seed, and the first ``eval_fraction`` of them held out
(:func:`split_domain`). The eval text of a domain is made of held-out files only; the calibration
text of calibration files only, of every domain asked for: the two never share a file or a byte.

Both are cut into pieces of about ``piece_chars`` characters at line ends, shuffled with the same
seed and capped: the calibration text at ``calib_chars`` per domain, the domains alternating piece
by piece (the ladder reads its first sequences for the imatrix, the Hessians and the Fisher table:
both domains are in them), written as ``.jsonl`` (one piece per line, a document for ``voodoo
data``); each eval text at ``eval_chars``, pieces joined by blank lines (llama-perplexity scores
its first ``--chunks``; many files, not the start of one). The texts depend on nothing but the
files and these settings; their sha256 is part of every result's digest.
"""

from __future__ import annotations

import hashlib
import json
import random
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

DOMAINS = ("plays", "python")
# Folders of the standard library that are not its hand-written code (or differ between machines).
EXCLUDE_DIRS = frozenset({"site-packages", "dist-packages", "test", "tests", "idle_test", "__pycache__", "encodings",
                          "pydoc_data"})


@dataclass(frozen=True)
class Domain:
    name: str
    root: Path
    pattern: str


def domain(name: str, root: Path | None = None) -> Domain:
    """The domain `name` (``plays`` or ``python``), read from `root` instead of its default."""
    if name == "plays":
        if root is None:
            from voodoo_quant.tools.embedded import shakespeare_dir

            root = shakespeare_dir()
        return Domain(name, Path(root), "*.md")
    if name == "python":
        return Domain(name, Path(root if root is not None else sysconfig.get_paths()["stdlib"]), "*.py")
    raise ValueError(f"unknown text domain {name!r}; known: {', '.join(DOMAINS)}")


def domain_files(d: Domain) -> list[tuple[str, str]]:
    """(relative path, text) of every usable file of `d`: sorted, non-empty, UTF-8, one per content."""
    out, seen = [], set()
    for p in sorted(d.root.rglob(d.pattern), key=lambda p: p.relative_to(d.root).as_posix()):
        rel = p.relative_to(d.root)
        if not p.is_file() or any(part in EXCLUDE_DIRS or part.startswith(".") for part in rel.parts[:-1]):
            continue
        try:
            text = p.read_text(encoding="utf-8")
        except (UnicodeDecodeError, OSError):
            continue
        h = hashlib.sha256(text.encode()).hexdigest()
        if text.strip() and h not in seen:
            seen.add(h)
            out.append((rel.as_posix(), text))
    if len(out) < 2:
        raise ValueError(f"{d.root} holds {len(out)} usable {d.pattern} file(s): a domain needs two to split")
    return out


def split_domain(names: list[str], fraction: float, seed: int, domain_name: str) -> tuple[list[str], list[str]]:
    """(calibration, held out): a seeded choice of round(fraction·n) held-out names (at least 1, at
    most n − 1), each list in the shuffled order."""
    if not 0 < fraction < 1:
        raise ValueError(f"eval_fraction must be in (0, 1), got {fraction}")
    order = list(names)
    random.Random(f"{domain_name}-{seed}").shuffle(order)  # a str seed: the same on every machine
    n_eval = min(len(order) - 1, max(1, round(fraction * len(order))))
    return order[n_eval:], order[:n_eval]


def pieces(text: str, size: int) -> list[str]:
    """`text` cut at line ends into pieces of at least `size` characters (the last may be shorter);
    each piece is an exact substring of `text`."""
    out, cur, n = [], [], 0
    for line in text.splitlines(keepends=True):
        cur.append(line)
        n += len(line)
        if n >= size:
            out.append("".join(cur))
            cur, n = [], 0
    if cur:
        out.append("".join(cur))
    return [p for p in out if p.strip()]


def _sample(texts: list[str], piece_chars: int, budget: int, rng: random.Random) -> list[str]:
    """Pieces of `texts`, shuffled, as many as fit in `budget` characters (at least one)."""
    ps = [p for t in texts for p in pieces(t, piece_chars)]
    rng.shuffle(ps)
    out, n = [], 0
    for p in ps:
        if out and n + len(p) > budget:
            break
        out.append(p)
        n += len(p)
    return out


@dataclass
class Texts:
    calib: Path  # .jsonl, one piece per line
    calib_sha256: str
    evals: dict[str, Path]  # domain → eval text
    eval_sha256: dict[str, str]
    split: dict[str, dict[str, list[str]]] = field(default_factory=dict)  # domain → calib / held_out names
    eval_pieces: dict[str, list[str]] = field(default_factory=dict)  # what each eval text is joined from


def build_texts(domains: dict[str, Domain], calib: tuple[str, ...], out_dir: Path, *, eval_fraction: float = 0.2,
                seed: int = 0, calib_chars: int = 600_000, eval_chars: int = 200_000,
                piece_chars: int = 4000) -> Texts:
    """Write the calibration text of the `calib` domains and one eval text per domain of
    `domains` into `out_dir` (rewritten only when their content changes)."""
    from voodoo_quant.core import fileio

    bad = [c for c in calib if c not in domains]
    if bad or not calib:
        raise ValueError(f"calibration domains {list(calib)}: each must be one of {', '.join(domains)}")
    split, calib_streams, evals, shas, eval_pieces = {}, {}, {}, {}, {}
    for name, d in domains.items():
        files = dict(domain_files(d))
        cal, held = split_domain(list(files), eval_fraction, seed, name)
        split[name] = {"calib": cal, "held_out": held}
        rng = random.Random(f"pieces-{name}-{seed}")
        eval_pieces[name] = _sample([files[f] for f in held], piece_chars, eval_chars, rng)
        evals_text = "\n\n".join(eval_pieces[name])
        calib_streams[name] = _sample([files[f] for f in cal], piece_chars, calib_chars, rng)
        evals[name] = _write_if_changed(out_dir / f"eval-{name}.txt", evals_text, fileio)
        shas[name] = hashlib.sha256(evals_text.encode()).hexdigest()
    lines = []
    streams = [calib_streams[c] for c in calib]
    for i in range(max(len(s) for s in streams)):  # the domains alternate piece by piece
        lines += [json.dumps({"text": s[i]}, ensure_ascii=False) for s in streams if i < len(s)]
    calib_text = "\n".join(lines) + "\n"
    path = _write_if_changed(out_dir / f"calib-{'+'.join(calib)}.jsonl", calib_text, fileio)
    return Texts(path, hashlib.sha256(calib_text.encode()).hexdigest(), evals, shas, split, eval_pieces)


def _write_if_changed(path: Path, text: str, fileio) -> Path:
    if not (path.is_file() and path.read_text(encoding="utf-8") == text):
        fileio.write_text(path, text)
    return path
