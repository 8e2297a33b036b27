"""The Python API.

A whole ladder, exactly as ``voodoo quantize`` (the same config dataclass):

    from voodoo_quant.api import QuantizeConfig, quantize
    result = quantize(QuantizeConfig(model="./MyModel", texts=["corpus/"], sizes=(30, 45, 60), output_dir="out"))
    result.files  # {30: Path("out/MyModel.Voodoo30_IQ2_XXS.gguf"), ...}; out/README.md is the card

A small facade for notebooks: quantize an already loaded model to a target size, save a GGUF.

    q = VoodooQuantizer(model, tokenizer, VoodooConfig(compression_ratio=0.6, calib_texts=texts))
    q.quantize().save("out/MyModel.Voodoo60_IQ3_M.gguf")

It runs the same pipeline as the CLI (the same config dataclasses and library calls): the model
and tokenizer are saved as an HF checkpoint in a work directory, the calibration texts become
the training tokens (and, when the menu needs one, the imatrix), then train, then export.
"""

from __future__ import annotations

import logging
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Sequence

from .core import fileio
from .core.errors import ConfigError
from .model.modeling import hf_dir_missing
from .selection.menus import DEFAULT_CANDIDATES
from .tools.quantize import QuantizeConfig, QuantizeResult, quantize  # noqa: F401  (the ladder: `voodoo quantize`)
from .training.config import TrainConfig

log = logging.getLogger(__name__)


@dataclass
class VoodooConfig:
    compression_ratio: float | None = None  # default 0.45 when target_bits is not given either
    target_bits: float | None = None
    calib_texts: Sequence[str] = ()
    # shorter than train's SEQ_LEN (512): a notebook's calib_texts are a few paragraphs, and every
    # sequence must be whole; 50 steps as `voodoo quantize` (WHITEPAPER, training steps)
    seq_len: int = 256
    max_steps: int = 50
    lr: float = 0.5
    distill_weight: float = 1.0
    size_tolerance: float = 0.02
    candidate_types: tuple[str, ...] = DEFAULT_CANDIDATES
    attention_candidates: tuple[str, ...] | None = None
    non_attention_candidates: tuple[str, ...] | None = None
    imatrix: str | None = None  # an imatrix file; None = compute one from calib_texts
    device: str = "cpu"
    dtype: str = "float32"
    seed: int = 0
    workdir: str | None = None  # default: a fresh temporary directory
    extra: dict[str, Any] = field(default_factory=dict)  # any other TrainConfig field

    def __post_init__(self) -> None:
        if self.compression_ratio is None and self.target_bits is None:
            self.compression_ratio = 0.45
        if self.compression_ratio is not None and self.target_bits is not None:
            raise ConfigError("give compression_ratio or target_bits, not both")
        if isinstance(self.calib_texts, str):
            self.calib_texts = [self.calib_texts]
        if not self.calib_texts or not any(t.strip() for t in self.calib_texts):
            raise ConfigError("calib_texts: give at least one non-empty calibration text")


class VoodooQuantizer:
    def __init__(self, model: Any, tokenizer: Any, config: VoodooConfig):
        self.model = model
        self.tokenizer = tokenizer
        self.config = config
        self.workdir = Path(config.workdir or tempfile.mkdtemp(prefix="voodoo-"))

    def _tokens(self, out: Path) -> Path:
        import torch

        eos = self.tokenizer.eos_token_id
        ids: list[int] = []
        for text in self.config.calib_texts:
            ids += self.tokenizer(text, add_special_tokens=True)["input_ids"]
            if eos is not None:
                ids.append(int(eos))
        n = len(ids) // self.config.seq_len
        if n < 1:
            raise ConfigError(
                f"calib_texts give {len(ids)} tokens: fewer than one sequence of seq_len {self.config.seq_len}"
            )
        seqs = torch.tensor(ids[: n * self.config.seq_len], dtype=torch.int64).reshape(n, self.config.seq_len)
        return fileio.torch_save(out, seqs)

    def model_dir(self) -> Path:
        """The model and tokenizer as an HF checkpoint dir, ``<workdir>/model``: saved into a
        temporary directory renamed into place, so a run killed while saving leaves none; reused
        only when complete (a half directory, from a run of an older version killed midway, is
        saved again)."""
        import shutil

        hf = self.workdir / "model"
        if hf.exists():
            missing = hf_dir_missing(hf)
            if not missing:
                return hf
            log.warning("%s is incomplete (missing or cut short: %s): saving the model again", hf, ", ".join(missing))
            shutil.rmtree(hf)
        for stale in self.workdir.glob(f".{hf.name}.*{fileio.TMP_SUFFIX}"):  # left by a killed save
            shutil.rmtree(stale, ignore_errors=True)

        def write(tmp: Path) -> None:
            self.model.save_pretrained(tmp)
            self.tokenizer.save_pretrained(tmp)

        return fileio.write_dir(hf, write)

    def quantize(self) -> "QuantizedModel":
        from .tools.calibrate import ImatrixConfig, compute  # lazy: `import voodoo_quant.api` stays free of torch
        from .training.trainer import Trainer  # lazy: `import voodoo_quant.api` stays free of torch
        from .tools.memory_check import check_memory  # lazy: `import voodoo_quant.api` stays free of torch

        cfg = self.config
        hf = self.model_dir()
        data = self.workdir / "data"
        tokens = self._tokens(data / "train_tokens.pt")
        imatrix = cfg.imatrix if cfg.imatrix is not None else str(self.workdir / "imatrix.gguf")
        tcfg = TrainConfig(
            model=str(hf), data_dir=str(data), imatrix=imatrix, compression_ratio=cfg.compression_ratio,
            target_bits=cfg.target_bits, seq_len=cfg.seq_len, max_steps=cfg.max_steps, lr=cfg.lr,
            distill_weight=cfg.distill_weight, size_tolerance=cfg.size_tolerance, candidate_types=cfg.candidate_types,
            attention_candidates=cfg.attention_candidates, non_attention_candidates=cfg.non_attention_candidates,
            device=cfg.device, dtype=cfg.dtype, seed=cfg.seed, output_dir=str(self.workdir / "run"), **cfg.extra,
        )
        tcfg = check_memory(tcfg).cfg  # before the imatrix, Hessians and candidates: what fits (--memory_check)
        if cfg.imatrix is None:
            compute(ImatrixConfig(str(hf), str(tokens), imatrix))
        result = Trainer(tcfg).train()
        return QuantizedModel(hf, imatrix, result)


@dataclass
class QuantizedModel:
    model_dir: Path
    imatrix: str
    result: Any  # training.trainer.TrainResult

    @property
    def assignment(self):
        return self.result.assignment

    def save(self, path: str | Path, *, overwrite: bool = True, allow_mismatch: bool = False):
        """Write the GGUF (atomically) and its tensor-type file; returns the ExportResult.

        The export checks the assignment's provenance (imatrix, base weights, libggml, menus)
        and raises ``provenance.ProvenanceMismatchError`` on a mismatch unless `allow_mismatch`."""
        from .tools.export import ExportConfig, export  # lazy: `import voodoo_quant.api` stays free of torch

        path = Path(path)
        if path.suffix != ".gguf":
            raise ConfigError(f"{path}: the output must be a .gguf file")
        return export(ExportConfig(model=self.model_dir, assignment=self.assignment, output_dir=path.parent,
                                   imatrix=Path(self.imatrix), output_name=path.name, overwrite=overwrite,
                                   allow_mismatch=allow_mismatch))
