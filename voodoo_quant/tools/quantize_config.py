"""`voodoo quantize`'s settings: :class:`QuantizeConfig`, shared by the CLI (``cli/quantize.py``)
and the Python API (``voodoo_quant.api.quantize``), checked when it is made (before any long
work), and what it hands each size's training (:meth:`QuantizeConfig.train_config`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..core import qtypes as qt
from ..core.errors import ConfigError
from ..model.modeling import is_gguf
from ..training.config import SEQ_LEN, TrainConfig

FLOOR = "Q8_0"  # always measured: the KLD floor of every table
# Fields QuantizeConfig sets itself; `train_extra` may not override them.
_OWNED = {"model", "data_dir", "data_name", "output_dir", "output_name", "imatrix", "compression_ratio", "target_bits",
          "target_size",
          "max_steps", "seq_len", "candidate_types", "attention_candidates", "non_attention_candidates", "seed",
          "device", "dtype", "lazy", "batch_size", "dry_run", "tensor_parallel", "finalize_from_partial",
          "resume_from_partial", "log_file", "text_model_class"}


@dataclass
class QuantizeConfig:
    model: str  # HF checkpoint dir or GGUF file
    texts: list[str]  # text files, folders, .jsonl files (as `voodoo data`)
    sizes: tuple[int, ...] = (30, 45, 60)  # standard sizes: percent of the uniform-Q8_0 bytes
    output_dir: Path = Path("voodoo-out")
    model_name: str | None = None  # <Model> in file names; default from the model's file/dir name
    # data
    seq_len: int = SEQ_LEN
    eval_fraction: float = 0.1
    eval_texts: list[str] = field(default_factory=list)
    glob: str = "*"
    # teacher
    degrid_seed: int | None = None  # de-grid a model whose weights are a dequantized quant (docs/facts.md)
    text_model_class: str | None = None
    # imatrix
    calib_sequences: int = 64
    # training (anything else of TrainConfig goes in train_extra)
    max_steps: int = 50  # fewer than train's 100: a ladder trains every size (WHITEPAPER, training steps)
    batch_size: int = 1
    candidate_types: tuple[str, ...] | None = None
    attention_candidates: tuple[str, ...] | None = None
    non_attention_candidates: tuple[str, ...] | None = None
    seed: int = 0
    device: str = "cpu"
    dtype: str = "float32"
    lazy: bool = False
    train_extra: dict[str, Any] = field(default_factory=dict)
    share_teacher_forward: bool = True  # cache the teacher's hidden states across sizes (exact)
    # evaluation
    stock: tuple[str, ...] | None = None  # llama-quantize recipes; default: each size's badge + Q8_0
    eval: bool = True
    ctx: int = 512  # -c of llama-perplexity
    chunks: int | None = 20
    workers: int | None = None  # threads of the stock tools; default VOODOO_QUANT_WORKERS
    # the whole file's size instead of a percent (training/target_size.py): one file, named by --sizes' one size
    target_size: str | None = None
    # the card
    license: str | None = None  # default: the source's own (GGUF general.license / HF README)
    base_model: str | None = None  # default: the source's own, else its name

    def __post_init__(self) -> None:
        from .export import canonical_name  # lazy: voodoo_quant.api imports this module

        self.output_dir = Path(self.output_dir)
        src = Path(self.model)
        if not (is_gguf(src) or (src.is_dir() and (src / "config.json").is_file())):
            what = "does not exist" if not src.exists() else "is neither a GGUF file nor an HF checkpoint dir (no config.json)"
            raise ConfigError(f"--model {src} {what}")
        if isinstance(self.texts, (str, Path)):
            self.texts = [self.texts]
        self.texts = [str(t) for t in self.texts]
        self.eval_texts = [str(t) for t in self.eval_texts]
        if not self.texts:
            raise ConfigError("--text: give at least one text file, folder or .jsonl file")
        for t in [*self.texts, *self.eval_texts]:
            if not Path(t).exists():
                raise ConfigError(f"--text {t} does not exist")
        sizes = []
        for s in (self.sizes if isinstance(self.sizes, (list, tuple)) else [self.sizes]):
            if isinstance(s, bool) or not isinstance(s, int) and not (isinstance(s, str) and s.strip().isdigit()):
                raise ConfigError(f"--sizes: {s!r} is not a whole percent (e.g. 45 for Voodoo45)")
            sizes.append(int(s))
        if not sizes:
            raise ConfigError("--sizes: give at least one size")
        if len(set(sizes)) != len(sizes):
            raise ConfigError(f"--sizes: {sizes} repeats a size")
        bad = [s for s in sizes if not 1 <= s <= 100]
        if bad:
            raise ConfigError(f"--sizes: {bad} outside 1..100 (percent of the uniform Q8_0 size, e.g. 45 for Voodoo45)")
        self.sizes = tuple(sorted(sizes))
        if self.model_name is None:
            self.model_name = default_model_name(src)
        for s in self.sizes:
            canonical_name(self.model_name, s)  # export's naming rule: refuses a size it cannot name
        if self.ctx < 8 or self.ctx % 2:
            raise ConfigError(f"--ctx must be an even number >= 8, got {self.ctx}")
        if self.target_size is not None and len(self.sizes) != 1:
            raise ConfigError(f"--target_size makes one file: give the size it is named by as one --sizes value "
                              f"(got {len(self.sizes)} sizes)")
        for flag, v in (("--calib_sequences", self.calib_sequences), ("--max_steps", self.max_steps),
                        ("--chunks", 1 if self.chunks is None else self.chunks)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ConfigError(f"{flag} must be an integer >= 1, got {v!r}")
        if self.stock is not None:
            bad = [r for r in self.stock if r not in qt.LLAMA_FTYPES]
            if bad:
                raise ConfigError(f"--stock: unknown llama-quantize recipe(s) {', '.join(bad)}; known: {', '.join(qt.LLAMA_FTYPES)}")
        self.stock = tuple(dict.fromkeys([*(self.stock if self.stock is not None else _badges(self.sizes)), FLOOR]))
        clash = sorted(set(self.train_extra) & _OWNED)
        if clash:
            raise ConfigError(f"train flags {', '.join('--' + c for c in clash)} are set by `voodoo quantize` itself "
                              "(use its own flags: --max_steps, --seq_len, --sizes, --target_size, menus, --seed, --device, "
                              "--dtype, --lazy)")
        self.train_config(self.sizes[0], Path("."))  # validates every train setting now, not after the data step
        self.menus = TrainConfig(model="x", compression_ratio=0.5, **self._menu_kw()).menus

    def _menu_kw(self) -> dict[str, Any]:
        kw = {"attention_candidates": self.attention_candidates, "non_attention_candidates": self.non_attention_candidates}
        if self.candidate_types:
            kw["candidate_types"] = self.candidate_types
        return kw

    def train_config(self, size: int, teacher_hf: Path, data_dir: Path | None = None, imatrix: Path | None = None,
                     run_dir: Path | None = None):
        return TrainConfig(
            model=str(teacher_hf), data_dir=str(data_dir or "data"), imatrix=str(imatrix) if imatrix else None,
            **({"target_size": self.target_size} if self.target_size is not None else {"compression_ratio": size / 100.0}),
            seq_len=self.seq_len, batch_size=self.batch_size, max_steps=self.max_steps,
            seed=self.seed, device=self.device, dtype=self.dtype, lazy=self.lazy, text_model_class=None,
            output_dir=str(run_dir or "run"), output_name=f"{self.model_name}-Voodoo{size}.pt",
            **self._menu_kw(), **self.train_extra,
        )


def _badges(sizes) -> list[str]:
    out = []
    for s in sizes:
        try:
            out.append(qt.badge_for(s))
        except Exception:  # noqa: BLE001 - a size without a badge has no same-class stock recipe
            continue
    return out


def default_model_name(src: Path) -> str:
    """``MyModel`` of ``MyModel/`` or ``MyModel.Q4_1.gguf`` / ``MyModel-Q4_K_M.gguf``."""
    import re

    if src.suffix.lower() != ".gguf":
        return src.resolve().name
    stem = src.stem
    for q in sorted({*qt.LLAMA_FTYPES, "F32", "F16", "BF16"}, key=len, reverse=True):
        m = re.fullmatch(rf"(.+?)[.\-_]{re.escape(q)}", stem, re.IGNORECASE)
        if m:
            return m.group(1)
    return stem
