"""`voodoo data`: tokenize a corpus into fixed-length train / eval sequences.

Inputs are *documents*: a text file is one document, a folder gives one document per matching
file (recursively), a ``.jsonl`` file one document per line (its `text_field`), a hub dataset one
per row. The split is by document, decided before tokenizing, and each split is packed on its
own, so no sequence ever crosses it. Documents are joined by the tokenizer's own convention: a
BOS before each document when the tokenizer adds one (``add_bos_token``), an EOS after each.
The tail of a split that does not fill a whole sequence is dropped (and counted in meta.json).

Outputs (``output_dir``): ``train_tokens.pt`` and ``eval_tokens.pt`` — each a plain int64 tensor
``[n_sequences, seq_len]`` — and ``meta.json`` (tokenizer identity, counts, sources + sha256).
"""

from __future__ import annotations

import hashlib
import json
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterable

from ..core import fileio
from ..core.errors import ConfigError, CorruptFileError, VoodooError
from ..model.modeling import load_tokenizer

TRAIN_NAME = "train_tokens.pt"
EVAL_NAME = "eval_tokens.pt"
META_NAME = "meta.json"


class DataInputError(VoodooError):
    """Empty, unreadable or too-small input."""

    exit_code = 2


@dataclass
class DataConfig:
    model: str  # tokenizer source: HF dir, GGUF file or hub id
    inputs: list[str]  # text files, folders, .jsonl files
    output_dir: Path
    seq_len: int = 2048
    eval_fraction: float = 0.1  # of the documents, when no eval_files are given
    eval_files: list[str] = field(default_factory=list)  # explicit eval documents (any input kind)
    glob: str = "*"  # file pattern inside folders (searched recursively)
    text_field: str = "text"  # of .jsonl rows and hub datasets
    dataset: str | None = None  # a `datasets` hub name (network permitting)
    dataset_split: str = "train"
    seed: int = 0
    progress: bool = True

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        self.inputs = [str(i) for i in self.inputs]
        self.eval_files = [str(i) for i in self.eval_files]
        if not self.inputs and self.dataset is None:
            raise ConfigError("no inputs: give text files, folders or .jsonl files (or --dataset)")
        if self.seq_len < 2:
            raise ConfigError(f"--seq_len must be >= 2, got {self.seq_len}")
        if not self.eval_files and not 0.0 < self.eval_fraction < 1.0:
            raise ConfigError(f"--eval_fraction must be in (0, 1), got {self.eval_fraction}")
        if not self.glob:
            raise ConfigError("--glob must not be empty")


@dataclass
class Document:
    source: str
    text: str


@dataclass
class DataResult:
    train_path: Path
    eval_path: Path
    meta_path: Path
    meta: dict[str, Any]


# -- reading documents -------------------------------------------------------------------------

def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise DataInputError(f"{path} is not UTF-8 text (byte {e.start}); convert it or exclude it with --glob") from None
    except OSError as e:
        raise DataInputError(f"cannot read {path}: {e.strerror or e}") from None


def _read_jsonl(path: Path, text_field: str) -> list[Document]:
    docs = []
    for i, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as e:
            raise DataInputError(f"{path}:{i} is not valid JSON: {e.msg}") from None
        if not isinstance(row, dict) or not isinstance(row.get(text_field), str):
            raise DataInputError(f"{path}:{i} has no string field {text_field!r}")
        docs.append(Document(f"{path}:{i}", row[text_field]))
    return docs


def expand_input(item: str, glob: str) -> list[Path]:
    """The files one input names: itself, or the matching files under a folder (sorted)."""
    p = Path(item)
    if p.is_dir():
        files = sorted(f for f in p.rglob(glob) if f.is_file() and not any(s.startswith(".") for s in f.relative_to(p).parts))
        if not files:
            raise DataInputError(f"folder {p} has no files matching {glob!r}")
        return files
    if p.is_file():
        return [p]
    raise DataInputError(f"input {p} does not exist")


def read_documents(files: Iterable[Path], text_field: str) -> tuple[list[Document], list[dict[str, Any]]]:
    """Documents of `files` and one source record (path, sha256, documents) per file."""
    docs: list[Document] = []
    sources: list[dict[str, Any]] = []
    for f in files:
        file_docs = _read_jsonl(f, text_field) if f.suffix.lower() == ".jsonl" else [Document(str(f), _read_text(f))]
        file_docs = [d for d in file_docs if d.text.strip()]
        docs.extend(file_docs)
        sources.append({"path": str(f.resolve()), "sha256": fileio.sha256_file(f), "documents": len(file_docs)})
    return docs, sources


def _hub_documents(cfg: DataConfig) -> tuple[list[Document], list[dict[str, Any]]]:
    try:
        import datasets  # optional; only where the network allows
    except ImportError:
        raise ConfigError("--dataset needs the `datasets` package (pip install datasets)") from None
    try:
        ds = datasets.load_dataset(cfg.dataset, split=cfg.dataset_split)
    except Exception as e:  # datasets raises many unrelated types for "not reachable"
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise DataInputError(f"cannot load dataset {cfg.dataset!r}: {first}") from None
    if cfg.text_field not in ds.column_names:
        raise DataInputError(f"dataset {cfg.dataset!r} has no column {cfg.text_field!r} (has {ds.column_names})")
    docs = [Document(f"{cfg.dataset}[{i}]", t) for i, t in enumerate(ds[cfg.text_field]) if t and t.strip()]
    fp = getattr(ds, "_fingerprint", "")
    return docs, [{"path": f"hub:{cfg.dataset}/{cfg.dataset_split}", "sha256": fp, "documents": len(docs)}]


# -- splitting and packing ---------------------------------------------------------------------

def split_documents(docs: list[Document], fraction: float, seed: int) -> tuple[list[Document], list[Document]]:
    """(train, eval) by document: a seeded choice of round(fraction·n) (at least 1) eval documents."""
    if len(docs) < 2:
        raise DataInputError(
            f"{len(docs)} document(s) cannot be split into train and eval; give more files or --eval_files"
        )
    n_eval = min(len(docs) - 1, max(1, round(fraction * len(docs))))
    order = list(range(len(docs)))
    random.Random(seed).shuffle(order)
    eval_idx = set(order[:n_eval])
    train = [d for i, d in enumerate(docs) if i not in eval_idx]
    evals = [d for i, d in enumerate(docs) if i in eval_idx]
    return train, evals


def joiner(tokenizer) -> tuple[int | None, int | None]:
    """(bos, eos) ids put around each document: BOS only if the tokenizer itself adds one."""
    bos = tokenizer.bos_token_id if getattr(tokenizer, "add_bos_token", False) else None
    return bos, tokenizer.eos_token_id


def pack(docs: list[Document], tokenizer, seq_len: int, progress=None) -> tuple[Any, dict[str, int]]:
    """Tokenize and pack documents into ``[n, seq_len]`` int64; the incomplete tail is dropped."""
    import torch

    bos, eos = joiner(tokenizer)
    stream: list[int] = []
    for d in docs:
        ids = tokenizer(d.text, add_special_tokens=False)["input_ids"]
        if bos is not None:
            stream.append(bos)
        stream.extend(ids)
        if eos is not None:
            stream.append(eos)
        if progress is not None:
            progress()
    n = len(stream) // seq_len
    tokens = torch.tensor(stream[: n * seq_len], dtype=torch.int64).reshape(n, seq_len)
    return tokens, {"documents": len(docs), "tokens": len(stream), "sequences": n, "dropped_tokens": len(stream) - n * seq_len}


def tokenizer_identity(tokenizer, source: str) -> dict[str, Any]:
    vocab = tokenizer.get_vocab()
    h = hashlib.sha256(json.dumps(sorted(vocab.items(), key=lambda kv: kv[1])).encode()).hexdigest()
    bos, eos = joiner(tokenizer)
    return {
        "source": source,
        "class": type(tokenizer).__name__,
        "vocab_size": len(tokenizer),
        "vocab_sha256": h,
        "bos_id": tokenizer.bos_token_id,
        "eos_id": tokenizer.eos_token_id,
        "joiner": {"bos_before_document": bos is not None, "eos_after_document": eos is not None},
    }


def load_tokens(path: str | Path, *, what: str = "token file"):
    """A ``[n, seq_len]`` int64 token tensor written by :func:`make_data`, checked."""
    import torch

    t = fileio.torch_load(path, what=what)
    if not isinstance(t, torch.Tensor) or t.dtype != torch.int64 or t.ndim != 2 or t.shape[0] == 0:
        raise CorruptFileError(f"{what} {path} is not a non-empty [n, seq_len] int64 tensor")
    return t


# -- the command -------------------------------------------------------------------------------

def make_data(cfg: DataConfig) -> DataResult:
    from rich.progress import Progress

    eval_set = {Path(e).resolve() for e in cfg.eval_files}
    train_files: list[Path] = []
    for item in cfg.inputs:
        train_files += [f for f in expand_input(item, cfg.glob) if f.resolve() not in eval_set]
    eval_files = [f for e in cfg.eval_files for f in expand_input(e, cfg.glob)]
    train_docs, sources = read_documents(train_files, cfg.text_field)
    if cfg.dataset is not None:
        hub_docs, hub_sources = _hub_documents(cfg)
        train_docs += hub_docs
        sources += hub_sources
    for s in sources:
        s["split"] = "train" if eval_files else "mixed"
    if eval_files:
        eval_docs, eval_sources = read_documents(eval_files, cfg.text_field)
        for s in eval_sources:
            s["split"] = "eval"
        sources += eval_sources
        if not eval_docs:
            raise DataInputError("the --eval_files hold no text")
    else:
        if not train_docs:
            raise DataInputError("the inputs hold no text (every file is empty)")
        train_docs, eval_docs = split_documents(train_docs, cfg.eval_fraction, cfg.seed)
    if not train_docs:
        raise DataInputError("the inputs hold no training text (every file is empty or an eval file)")

    tokenizer = load_tokenizer(cfg.model)
    with Progress(disable=not cfg.progress, transient=True) as bar:
        task = bar.add_task("tokenizing", total=len(train_docs) + len(eval_docs))
        step = lambda: bar.advance(task)  # noqa: E731
        train, train_counts = pack(train_docs, tokenizer, cfg.seq_len, step)
        evals, eval_counts = pack(eval_docs, tokenizer, cfg.seq_len, step)
    for name, counts in (("train", train_counts), ("eval", eval_counts)):
        if counts["sequences"] == 0:
            raise DataInputError(
                f"the {name} split has {counts['tokens']} tokens, too few for one sequence of "
                f"--seq_len {cfg.seq_len}"
            )

    meta = {
        "format": "voodoo-tokens/1",
        "seq_len": cfg.seq_len,
        "tokenizer": tokenizer_identity(tokenizer, str(cfg.model)),
        "split": {"eval_fraction": None if eval_files else cfg.eval_fraction, "seed": cfg.seed,
                  "eval_documents": sorted(d.source for d in eval_docs)},
        "train": train_counts,
        "eval": eval_counts,
        "sources": sources,
    }
    out = cfg.output_dir
    train_path = fileio.torch_save(out / TRAIN_NAME, train)
    eval_path = fileio.torch_save(out / EVAL_NAME, evals)
    meta_path = fileio.write_json(out / META_NAME, meta)
    return DataResult(train_path, eval_path, meta_path, meta)
