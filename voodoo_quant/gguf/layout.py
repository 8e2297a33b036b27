"""The layout map: where every element of an HF tensor lies in the GGUF tensor llama.cpp serves.

llama.cpp's converter rewrites some tensors on the way into the GGUF (Llama's q/k rope
permutation, Qwen3.5's linear-attention V-head reorder, LFM2's conv squeeze, ...). For export
bytes to equal training candidates, the candidate of an HF tensor ``W`` must be

    from_gguf(dequantize(quantize(to_gguf(W))))

i.e. quantized *as it lies in the GGUF* (rows = GGUF ne[0] rows) and mapped back. We learn the
map from the converter itself: its ``modify_tensors`` is run on an index tensor
(``arange(numel)``, integers are exact) and the result tells where each element goes. A result
that is not a permutation of the input (arithmetic, splits, merges) makes the tensor
non-selectable rather than guessed.

A permutation is stored compactly when it factors as a row permutation × a column permutation
(optionally transposed), which covers every transform of the shipped architectures; a full
gather index is kept only otherwise.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..core.errors import ConfigError, CorruptFileError, QuantizationInputError
from . import converter

# llama-quantize only quantizes >= 2-D tensors whose name ends in "weight" and that are not
# in its exclusion list (src/llama-quant.cpp tensor_allows_quantization). The subset that
# can occur in text decoders converted by convert_hf_to_gguf.py:
_NOT_QUANTIZED = (
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "position_embd", "token_types", "ssm_conv1d", "shortconv.conv.weight",
    "indexer.k_proj.weight", "indexer.q_proj.weight", "attn_rel_b.weight", "time_mix_",
)


def ggml_n_dims(ne) -> int:
    """ggml_n_dims (ggml/src/ggml.c): the dimensions up to the last one larger than 1, so a
    [4096, 1] tensor counts as 1-D. `ne` in ggml order (ne[0] = row length)."""
    ne = [int(x) for x in ne]
    for i in range(len(ne) - 1, 0, -1):
        if ne[i] > 1:
            return i + 1
    return 1


def llama_quantize_allows(gguf_name: str, n_dims: int) -> bool:
    """Whether stock llama-quantize would quantize a tensor (src/llama-quant.cpp)."""
    if n_dims < 2 or not gguf_name.endswith("weight"):
        return False
    return not any(s in gguf_name for s in _NOT_QUANTIZED)


@dataclass(frozen=True)
class TensorLayout:
    """HF tensor (as torch holds it) ↔ GGUF tensor (as the converter writes it)."""

    hf_name: str  # name in the checkpoint
    gguf_name: str
    hf_shape: tuple[int, ...]
    gguf_shape: tuple[int, ...]  # numpy order (last = ggml ne[0], the row length)
    # gguf2d[i, j] = hf2d[rows[i], cols[j]]  (or hf2d[cols[j], rows[i]] when transposed);
    # None = identity along that axis. hf2d = the HF tensor viewed as (shape[0], rest).
    rows: np.ndarray | None = None
    cols: np.ndarray | None = None
    transposed: bool = False
    gather: np.ndarray | None = None  # a general permutation: gguf_flat = hf_flat[gather]
    quantizable: bool = True  # llama-quantize would quantize it

    @property
    def n_per_row(self) -> int:
        """GGUF row length (ne[0]): what block alignment, menus and fallbacks are judged on."""
        return int(self.gguf_shape[-1])

    @property
    def n_rows(self) -> int:
        return int(np.prod(self.gguf_shape[:-1], dtype=np.int64))

    @property
    def is_identity(self) -> bool:
        return self.rows is None and self.cols is None and not self.transposed and self.gather is None

    @property
    def hf2d_shape(self) -> tuple[int, int]:
        return (int(self.hf_shape[0]), int(np.prod(self.hf_shape[1:], dtype=np.int64)))

    def to_gguf(self, hf_tensor: Any) -> np.ndarray:
        """The tensor as it lies in the GGUF: float32, C-contiguous, (rows, n_per_row)."""
        w = _as_numpy(hf_tensor)
        if tuple(w.shape) != self.hf_shape:
            raise QuantizationInputError(f"{self.hf_name}: shape {tuple(w.shape)} != layout {self.hf_shape}")
        w2 = w.reshape(self.hf2d_shape)
        if self.gather is not None:
            out = w2.reshape(-1)[self.gather]
        else:
            if self.transposed:
                w2 = w2.T
            if self.rows is not None:
                w2 = w2[self.rows]
            if self.cols is not None:
                w2 = w2[:, self.cols]
            out = w2
        return np.ascontiguousarray(out.reshape(self.n_rows, self.n_per_row), dtype=np.float32)

    def from_gguf(self, gguf_2d: np.ndarray) -> np.ndarray:
        """Inverse of :meth:`to_gguf`: a GGUF-layout tensor back in the HF shape (float32)."""
        g = np.asarray(gguf_2d, dtype=np.float32)
        if g.size != self.n_rows * self.n_per_row:
            raise QuantizationInputError(f"{self.hf_name}: {g.size} values for GGUF shape {self.gguf_shape}")
        if self.gather is not None:
            out = np.empty(g.size, dtype=np.float32)
            out[self.gather] = g.reshape(-1)
            return out.reshape(self.hf_shape)
        r, c = self.hf2d_shape
        g2 = g.reshape((c, r) if self.transposed else (r, c))
        if self.cols is not None:
            inv = np.empty_like(g2)
            inv[:, self.cols] = g2
            g2 = inv
        if self.rows is not None:
            inv = np.empty_like(g2)
            inv[self.rows] = g2
            g2 = inv
        if self.transposed:
            g2 = g2.T
        return np.ascontiguousarray(g2).reshape(self.hf_shape)


    def from_gguf_torch(self, g: Any) -> Any:
        """:meth:`from_gguf` in torch, on the tensor's own device (lazy candidates on a GPU)."""
        import torch

        if self.is_identity:
            return g.reshape(self.hf_shape)
        dev = g.device
        if self.gather is not None:
            out = torch.empty(g.numel(), dtype=g.dtype, device=dev)
            out[torch.as_tensor(self.gather, device=dev)] = g.reshape(-1)
            return out.reshape(self.hf_shape)
        r, c = self.hf2d_shape
        g2 = g.reshape((c, r) if self.transposed else (r, c))
        if self.cols is not None:
            inv = torch.empty_like(g2)
            inv[:, torch.as_tensor(self.cols, device=dev)] = g2
            g2 = inv
        if self.rows is not None:
            inv = torch.empty_like(g2)
            inv[torch.as_tensor(self.rows, device=dev)] = g2
            g2 = inv
        if self.transposed:
            g2 = g2.T
        return g2.contiguous().reshape(self.hf_shape)


def _as_numpy(t: Any) -> np.ndarray:
    if hasattr(t, "detach"):
        t = t.detach().to("cpu")
        import torch

        if t.dtype != torch.float32:
            t = t.float()
        return t.numpy()
    return np.asarray(t, dtype=np.float32)


def _is_identity(a: np.ndarray) -> bool:
    return bool((a == np.arange(a.size, dtype=a.dtype)).all())


def _factor(perm: np.ndarray, hf2d: tuple[int, int], gguf_shape: tuple[int, ...]) -> dict[str, Any]:
    """Express gguf_flat = hf_flat[perm] as row/col permutations when possible."""
    n = int(np.prod(gguf_shape[:-1], dtype=np.int64)) if len(gguf_shape) > 1 else 1
    p2 = perm.reshape(n, int(gguf_shape[-1]))
    R, C = hf2d
    hr, hc = p2 // C, p2 % C
    for transposed, a, b in ((False, hr, hc), (True, hc, hr)):
        # a = source HF row of each GGUF element, b = source HF column (swapped if transposed)
        if a.shape[0] != (C if transposed else R) or a.shape[1] != (R if transposed else C):
            continue
        if (a == a[:, :1]).all() and (b == b[:1, :]).all():
            rows, cols = a[:, 0].copy(), b[0, :].copy()
            return {
                "rows": None if _is_identity(rows) else rows,
                "cols": None if _is_identity(cols) else cols,
                "transposed": transposed,
            }
    return {"gather": perm.copy()}


def _index_tensor(shape: tuple[int, ...]):
    import torch

    n = int(np.prod(shape, dtype=np.int64))
    # Integers are exact in int64; permutations, reshapes, splits and cats keep them intact.
    return torch.arange(n, dtype=torch.int64).reshape(shape)


def checkpoint_tensors(model_dir: Path) -> dict[str, tuple[int, ...]]:
    """{name: shape} of every tensor in the checkpoint's safetensors, from their headers alone
    (the one safetensors header parser: layout maps, export's space check, base checkpoints)."""
    model_dir = Path(model_dir)
    idx = model_dir / "model.safetensors.index.json"
    if idx.is_file():
        try:
            files = sorted(set(json.loads(idx.read_text())["weight_map"].values()))
        except (ValueError, KeyError, TypeError, AttributeError) as e:
            raise CorruptFileError(f"{idx} is not a safetensors index: {type(e).__name__}: {e}") from None
    else:
        files = sorted(p.name for p in model_dir.glob("model*.safetensors"))
    if not files:
        raise ConfigError(f"{model_dir}: no safetensors weights found")
    out: dict[str, tuple[int, ...]] = {}
    for f in files:
        path = model_dir / f
        try:
            with open(path, "rb") as fh:
                n = int.from_bytes(fh.read(8), "little")
                if n <= 0 or n > path.stat().st_size - 8:
                    raise ValueError(f"header length {n} does not fit the file")
                header = json.loads(fh.read(n))
            for k, v in header.items():
                if k != "__metadata__":
                    out[k] = tuple(int(s) for s in v["shape"])
        except OSError as e:
            raise CorruptFileError(f"{path}: cannot read ({e.strerror or e})") from None
        except (ValueError, KeyError, TypeError, AttributeError, MemoryError) as e:
            raise CorruptFileError(f"{path} is not a safetensors file: {type(e).__name__}: {e}") from None
    return out


def _bid(name: str) -> int | None:
    # prepare_tensors in conversion/base.py: the first number-like part is the block id.
    for part in name.split("."):
        if part.isdecimal():
            return int(part)
    return None


def model_layouts(model_dir: str | Path, *, min_dims: int = 2,
                  unmapped: dict[str, tuple[int, ...]] | None = None) -> dict[str, TensorLayout]:
    """{checkpoint tensor name: layout} for every >= `min_dims`-D tensor the converter maps to
    exactly one GGUF tensor by a permutation. Names the converter drops are absent.

    `unmapped`, when given, receives {GGUF name: shape (numpy order)} of the converter's outputs
    that got no layout (merged expert stacks, splits, arithmetic on an index it still returns):
    tensors the GGUF holds that no training candidate can stand for."""
    import torch

    model_dir = Path(model_dir)
    inst = converter.instantiate(model_dir)
    out: dict[str, TensorLayout] = {}
    with torch.inference_mode():
        for name, shape in checkpoint_tensors(model_dir).items():
            if len(shape) < min_dims:
                continue
            item = type(inst).filter_tensors((name, lambda: None))
            if item is None:
                continue
            conv_name = item[0]
            try:
                results = list(inst.modify_tensors(_index_tensor(shape), conv_name, _bid(conv_name)))
            except Exception:  # arithmetic on an integer tensor etc.: not a pure re-layout
                continue
            if len(results) != 1:
                _note_unmapped(unmapped, results)
                continue
            gguf_name, t = results[0]
            arr = t.numpy() if hasattr(t, "numpy") else np.asarray(t)
            flat = arr.reshape(-1)
            n = int(np.prod(shape, dtype=np.int64))
            if flat.size != n or flat.dtype.kind not in "iu" or flat.min() < 0 or flat.max() >= n \
                    or not (np.bincount(flat, minlength=n) == 1).all():
                _note_unmapped(unmapped, results)
                continue
            gshape = tuple(int(s) for s in arr.shape)
            hf2d = (int(shape[0]), n // int(shape[0]))
            fac = {} if _is_identity(flat) else _factor(flat, hf2d, gshape)
            out[name] = TensorLayout(
                hf_name=name, gguf_name=gguf_name, hf_shape=tuple(shape), gguf_shape=gshape,
                quantizable=llama_quantize_allows(gguf_name, ggml_n_dims(gshape[::-1])), **fac,
            )
    return out


def _note_unmapped(unmapped: dict | None, results) -> None:
    if unmapped is None:
        return
    for gguf_name, t in results:
        unmapped[gguf_name] = tuple(int(x) for x in t.shape)


def find_layout(layouts: dict[str, TensorLayout], hf_name: str) -> TensorLayout | None:
    """Look a parameter up by its checkpoint name, tolerating a stripped multimodal prefix
    (``model.language_model.`` ↔ ``model.``), as ``make-teacher --strip_prefix`` produces."""
    if hf_name in layouts:
        return layouts[hf_name]
    alt = re.sub(r"^model\.language_model\.", "model.", hf_name)
    if alt in layouts:
        return layouts[alt]
    for k, v in layouts.items():
        if re.sub(r"^model\.language_model\.", "model.", k) == alt:
            return v
    return None
