"""`voodoo imatrix`: an importance matrix from calibration tokens, computed in torch.

Mean of x² per input column of every selectable Linear, named as llama.cpp names the tensors
(learned from its own converter) and written in the GGUF format that stock ``llama-quantize
--imatrix`` reads. Column permutations the converter applies (Qwen3.5 ``ssm_out``) are applied
to the vectors too, so every vector lines up with the GGUF tensor's columns.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..core import fileio
from ..core.errors import ConfigError
from ..gguf.imatrix_compute import compute_imatrix
from ..gguf.layout import find_layout, model_layouts
from ..model import modeling
from ..training.models import load_into


@dataclass
class ImatrixConfig:
    model: str  # HF checkpoint dir
    tokens: str  # train_tokens.pt from `voodoo data`
    output: str = "imatrix.gguf"
    max_sequences: int | None = None
    batch_size: int = 1
    base_checkpoint: str | None = None
    text_model_class: str | None = None

    def __post_init__(self) -> None:
        if not Path(self.model).is_dir():
            raise ConfigError(f"--model {self.model} is not an HF checkpoint directory")
        if self.batch_size < 1 or (self.max_sequences is not None and self.max_sequences < 1):
            raise ConfigError("--batch_size and --max_sequences must be >= 1")


# llama-imatrix records no entry for the output head (src0 = output.weight is skipped by its
# collector, tools/imatrix/imatrix.cpp), nor for token_embd (a get_rows, not a matmul).
_NOT_RECORDED = ("output.weight", "token_embd.weight")


def compute(cfg: ImatrixConfig):
    import torch

    model = modeling.load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        load_into(model, cfg.base_checkpoint, "base checkpoint")
    tokens = fileio.torch_load(cfg.tokens, what="tokens file")
    if isinstance(tokens, dict):
        tokens = tokens.get("input_ids", tokens.get("tokens"))
    if not isinstance(tokens, torch.Tensor) or tokens.dim() != 2:
        raise ConfigError(f"{cfg.tokens} does not hold a [N, seq_len] token tensor")
    if cfg.max_sequences:
        tokens = tokens[: cfg.max_sequences]
    layouts = model_layouts(cfg.model)

    def name_map(hf_name: str):
        lay = find_layout(layouts, hf_name)
        if lay is None or lay.gguf_name in _NOT_RECORDED or not lay.quantizable:
            return None
        return lay.gguf_name

    def column_perm(hf_name: str):
        lay = find_layout(layouts, hf_name)
        if lay is None or lay.transposed or lay.gather is not None:
            return None
        return lay.cols

    batches = [tokens[i : i + cfg.batch_size] for i in range(0, tokens.shape[0], cfg.batch_size)]
    with torch.no_grad():
        imx = compute_imatrix(model, batches, name_map, column_perm=column_perm,
                              chunk_size=int(tokens.shape[1]), datasets=[str(cfg.tokens)])
    imx.save_gguf(cfg.output)
    return imx
