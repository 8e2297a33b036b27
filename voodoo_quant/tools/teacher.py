"""`voodoo make-teacher`: the base checkpoint and the llama.cpp-exact Q8_0 teacher.

From an HF checkpoint dir (safetensors, sharded or not; read one tensor at a time, so the model
is never held in float32) or from a GGUF file (loaded by transformers, see
:mod:`voodoo_quant.model.modeling`; held once in float32) this writes

- the base ``.pt``: the text model's state dict in ``dtype`` (bfloat16 default);
- the teacher ``.pt``: every 2-D weight as llama-quantize would store it in a Q8_0 file —
  Q8_0 blocks from libggml-base (kept packed: int8 ``qs`` + fp16 scale ``d`` per 32 weights;
  ``d * qs`` in float32 is exactly ggml's ``dequantize_row_q8_0``), F16 for rows that are not a
  multiple of 32 (llama-quantize's fallback, ``src/llama-quant.cpp``), F32 for 1-D tensors (norms
  stay F32 in llama.cpp files).

Both record the source's identity. ``degrid_seed`` de-grids a checkpoint whose float weights are
a dequantized quantized file (see :func:`degrid`), before either output is made.
"""

from __future__ import annotations

import hashlib
import re
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..core import fileio, ggml
from ..core.errors import ConfigError
from ..gguf.converter import vendored_gguf
from ..model import modeling
from ..model.checkpoints import (  # noqa: F401  (the format lives in the core; re-exported for callers)
    BASE_FORMAT, TEACHER_FORMAT, entry_to_float, load_base, load_teacher, module_from_checkpoint, teacher_entry,
)
from ..model.modeling import (
    ModelLoadError, _expected_keys, is_gguf, iter_hf_dir, load_config, load_tokenizer, model_from_state_dict,
    resolve_text_class, source_identity, text_state_dict,
)

_DTYPES = ("bfloat16", "float32")
DEGRID_BLOCK = 32
# 16 for a file with 16-weight sub-blocks of their own scale (Q6_K, Q3_K, Q2_K in
# ggml-quants.c): a 32-weight block then mixes two grids, and its smallest gap between distinct
# values is a gap across the two grids, far below either step, so 32 leaves them in place.
DEGRID_BLOCKS = (16, 32)
# the types whose scales span 16 weights: a GGUF holding any of them is de-gridded by 16
SIXTEEN_WEIGHT_SCALES = frozenset({"Q6_K", "Q3_K", "Q2_K"})


def degrid_block_for(model: str | Path) -> int:
    """The de-grid block a source needs: 16 when a GGUF holds a type with 16-weight scales (a
    Q4_K_M file's Q6_K tensors), else 32 (an HF checkpoint says nothing of what it came from)."""
    p = Path(model)
    if not is_gguf(p):
        return DEGRID_BLOCK
    types = {t.tensor_type.name for t in vendored_gguf().GGUFReader(p).tensors}
    return 16 if types & SIXTEEN_WEIGHT_SCALES else DEGRID_BLOCK


@dataclass
class MakeTeacherConfig:
    model: str  # HF checkpoint dir or GGUF file
    output_dir: Path
    base_name: str | None = None  # default: <model>_lm_base.pt
    teacher_name: str | None = None  # default: <model>_lm_teacher_q8_0.pt
    strip_prefix: str | None = None  # e.g. "model.language_model." of a multimodal wrapper
    text_model_class: str | None = None  # model_type or transformers class of the text model
    dtype: str = "bfloat16"  # of the base checkpoint
    degrid_seed: int | None = None
    # weights per block whose grid step sizes the noise (see degrid); None: degrid_block_for(model)
    degrid_block: int | None = None
    hf_out: Path | None = None  # also save the (de-gridded) float model as an HF dir
    progress: bool = True

    def __post_init__(self) -> None:
        self.output_dir = Path(self.output_dir)
        if self.hf_out is not None:
            self.hf_out = Path(self.hf_out)
        p = Path(self.model)
        if not (p.is_dir() or is_gguf(p)):
            raise ConfigError(f"--model {p} is neither an HF checkpoint dir nor a GGUF file")
        if self.dtype not in _DTYPES:
            raise ConfigError(f"--dtype must be one of {', '.join(_DTYPES)}, got {self.dtype!r}")
        if self.degrid_seed is not None and self.degrid_seed < 0:
            raise ConfigError(f"--degrid_seed must be >= 0, got {self.degrid_seed}")
        if self.degrid_block is None:
            self.degrid_block = degrid_block_for(p) if self.degrid_seed is not None else DEGRID_BLOCK
        if self.degrid_block not in DEGRID_BLOCKS:
            raise ConfigError(f"--degrid_block must be one of {', '.join(map(str, DEGRID_BLOCKS))}, got {self.degrid_block}")
        if is_gguf(p) and self.strip_prefix:
            raise ConfigError("--strip_prefix applies to HF checkpoints, not GGUF files")
        stem = re.sub(r"[^a-z0-9]+", "_", (p.stem if is_gguf(p) else p.resolve().name).lower()).strip("_")
        self.base_name = self.base_name or f"{stem}_lm_base.pt"
        self.teacher_name = self.teacher_name or f"{stem}_lm_teacher_q8_0.pt"


@dataclass
class TeacherResult:
    base_path: Path
    teacher_path: Path
    hf_out: Path | None
    tensors: int
    q8_tensors: int


# -- de-gridding -------------------------------------------------------------------------------

def grid_step(w, block: int = DEGRID_BLOCK):
    """Per block of `block` consecutive weights of a row: the smallest gap between its distinct
    values (0 for a block with fewer than two distinct values). Shape ``[rows, cols // block]``."""
    import torch

    b = torch.sort(w.reshape(w.shape[0], -1, block), dim=-1).values
    gaps = b[..., 1:] - b[..., :-1]
    gaps = torch.where(gaps > 0, gaps, torch.full_like(gaps, float("inf")))
    step = gaps.min(dim=-1).values
    return torch.where(torch.isinf(step), torch.zeros_like(step), step)


def degrid(name: str, w, seed: int, block: int = DEGRID_BLOCK):
    """`w` (float32, 2-D) plus uniform noise in ±step/2 of its `block`-weight block (docs/facts.md).

    A model whose float weights are a dequantized Q4_1 file lies on a grid that Q4_1/Q5_1
    reproduce exactly; the noise (as large as the original rounding) hides it. Deterministic:
    the generator is seeded from (seed, tensor name), independent of tensor order. Tensors that
    are not 2-D or whose rows are not a multiple of `block` are returned unchanged. A file whose
    types have 16-weight sub-blocks (Q6_K, Q3_K, Q2_K) needs ``block=16`` (see DEGRID_BLOCKS).
    """
    import torch

    if w.ndim != 2 or w.shape[1] % block:
        return w
    digest = hashlib.sha256(f"{seed}:{name}".encode()).digest()
    gen = torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))
    step = grid_step(w, block).repeat_interleave(block, dim=1)
    u = torch.rand(w.shape, generator=gen, dtype=torch.float32)
    return w + (u - 0.5) * step


# -- the command -------------------------------------------------------------------------------

def make_teacher(cfg: MakeTeacherConfig) -> TeacherResult:
    import torch
    from rich.progress import Progress

    src = Path(cfg.model)
    identity = source_identity(src).to_dict()
    base_dtype = getattr(torch, cfg.dtype)
    model = None
    if is_gguf(src):
        model = modeling.load_model(src, dtype=torch.float32)
        text_cfg, cls = model.config, type(model)
        tied = {k for k in model.state_dict() if k.endswith("lm_head.weight")} if text_cfg.tie_word_embeddings else set()
        items = [(k, v) for k, v in model.state_dict().items() if k not in tied]
        total = len(items)
        tensors: Iterator = iter(items)
    else:
        cls, text_cfg = resolve_text_class(load_config(src), cfg.text_model_class)
        total = len(_expected_keys(cls, text_cfg)[0])
        tensors = iter_hf_dir(src, cls, text_cfg, cfg.strip_prefix)

    base_sd: dict[str, Any] = {}
    teacher: dict[str, Any] = {}
    hf_sd: dict[str, Any] = {}
    with Progress(disable=not cfg.progress, transient=True) as bar:
        task = bar.add_task("teacher (Q8_0)", total=total)
        for name, w in tensors:
            if cfg.degrid_seed is not None:
                w = degrid(name, w, cfg.degrid_seed, cfg.degrid_block)
            base_sd[name] = w.to(base_dtype).contiguous()
            teacher[name] = teacher_entry(name, w)
            if cfg.hf_out is not None:
                hf_sd[name] = w
            bar.advance(task)

    header = {
        "source": identity,
        "model_class": cls.__name__,
        "config_json": text_cfg.to_json_string(),
        "strip_prefix": cfg.strip_prefix,
        "text_model_class": cfg.text_model_class,
        "degrid_seed": cfg.degrid_seed,
        "degrid_block": cfg.degrid_block if cfg.degrid_seed is not None else None,
    }
    base_path = fileio.torch_save(cfg.output_dir / cfg.base_name,
                                  {"format": BASE_FORMAT, **header, "dtype": cfg.dtype, "state_dict": base_sd})
    del base_sd
    teacher_path = fileio.torch_save(
        cfg.output_dir / cfg.teacher_name,
        {"format": TEACHER_FORMAT, **header, "quant": "Q8_0", "ggml_version": ggml.lib().version, "tensors": teacher},
    )
    n_q8 = sum(1 for e in teacher.values() if e["type"] == "Q8_0")
    if cfg.hf_out is not None:
        if model is None:
            model = model_from_state_dict(cls, text_cfg, hf_sd, dtype=torch.float32)
        else:
            model.load_state_dict(hf_sd, strict=False)
        save_hf_dir(model, load_tokenizer(src), cfg.hf_out)
    return TeacherResult(base_path, teacher_path, cfg.hf_out, len(teacher), n_q8)


def save_hf_dir(model, tokenizer, out: Path) -> Path:
    """save_pretrained into a temp dir beside `out`, then rename it into place (no partial dir).

    transformers 5 refuses to save a model loaded from GGUF unless its quantizer is dropped and
    ``quantization_config`` removed from the config (docs/facts.md).
    """
    out = Path(out)
    if out.exists():
        raise fileio.OutputExistsError(f"--hf_out {out} exists; remove it or choose another dir")
    model.hf_quantizer = None
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.", dir=out.parent))
    try:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        tmp.rename(out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return out
