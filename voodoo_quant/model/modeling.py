"""Loading models and tokenizers: an HF checkpoint dir, a GGUF file, or a hub id.

Shared by data, make-teacher, eval and the trainer. The *text model* is what we quantize: for a
multimodal wrapper (``model.language_model.*``) the text-only class is chosen with
``text_model_class`` (a ``model_type`` such as ``qwen3_5_text`` or a transformers class name
such as ``Qwen3_5ForCausalLM``) and built from the config's text section.

GGUF files are loaded through transformers (``gguf_file=``): it dequantizes with gguf-py, whose
``dequantize`` equals ggml ``to_float`` exactly for every type (checked for this project), and it
undoes llama.cpp's Q/K row permutation (``convert_hf_to_gguf.py`` LlamaModel.permute).
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from ..core.errors import ConfigError, CorruptFileError, VoodooError
from ..core.fileio import sha256_file


class ModelLoadError(VoodooError):
    exit_code = 2


def is_gguf(source: str | os.PathLike) -> bool:
    p = Path(source)
    return p.suffix.lower() == ".gguf" and p.is_file()


def _hf_kwargs(source: str | os.PathLike) -> tuple[str, dict[str, Any]]:
    """(pretrained path/id, extra kwargs) for transformers' from_pretrained."""
    p = Path(source)
    if is_gguf(p):
        return str(p.resolve().parent), {"gguf_file": p.name}
    if p.is_dir():
        return str(p), {}
    if p.suffix.lower() == ".gguf" or p.exists():
        raise ModelLoadError(f"model source {p} is neither an HF checkpoint dir nor a GGUF file")
    # Anything else is taken as a hub id; it works only where the network allows.
    return str(source), {}


def _wrap(what: str, source: Any, e: Exception) -> ModelLoadError:
    first = (str(e).strip().splitlines() or [type(e).__name__])[0]
    return ModelLoadError(f"cannot load {what} from {source}: {first}")


def load_tokenizer(source: str | os.PathLike):
    """The tokenizer of an HF dir, a GGUF file (its embedded vocab), or a hub id."""
    from transformers import AutoTokenizer

    path, kw = _hf_kwargs(source)
    try:
        return AutoTokenizer.from_pretrained(path, **kw)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise _wrap("tokenizer", source, e) from None


def load_config(source: str | os.PathLike):
    from transformers import AutoConfig

    path, kw = _hf_kwargs(source)
    try:
        return AutoConfig.from_pretrained(path, **kw)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise _wrap("config", source, e) from None


def resolve_text_class(config: Any, text_model_class: str | None):
    """(causal-LM class, text config) for `config`, optionally forced by `text_model_class`."""
    import transformers
    from transformers import CONFIG_MAPPING
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as LM_NAMES

    text_cfg = config.get_text_config(decoder=True)
    if text_model_class is None:
        cls_name = LM_NAMES.get(text_cfg.model_type) or LM_NAMES.get(config.model_type)
        if cls_name is None:
            raise ModelLoadError(
                f"no causal-LM class for model_type {text_cfg.model_type!r}; pass --text_model_class"
            )
        return getattr(transformers, cls_name), text_cfg
    if text_model_class in LM_NAMES:
        model_type, cls_name = text_model_class, LM_NAMES[text_model_class]
    elif hasattr(transformers, text_model_class):
        cls_name = text_model_class
        model_type = getattr(transformers, cls_name).config_class.model_type
    else:
        known = ", ".join(sorted(LM_NAMES)[:12])
        raise ConfigError(
            f"--text_model_class {text_model_class!r} is neither a causal-LM model_type nor a "
            f"transformers class (model_types include: {known}, ...)"
        )
    cls = getattr(transformers, cls_name)
    if text_cfg.model_type != model_type:
        # The text section of a wrapper config becomes the text-only config class.
        d = text_cfg.to_dict()
        d.pop("model_type", None)
        text_cfg = CONFIG_MAPPING[model_type](**d)
    return cls, text_cfg


def load_model(source: str | os.PathLike, *, text_model_class: str | None = None,
               strip_prefix: str | None = None, dtype: Any = None):
    """A causal LM from an HF dir / GGUF / hub id, in eval mode, on the CPU.

    With `text_model_class` / `strip_prefix`, only the text model of a wrapper is built; its
    weights are read by :func:`text_state_dict`.
    """
    import torch

    dtype = dtype or torch.float32
    path, kw = _hf_kwargs(source)
    if (text_model_class is not None or strip_prefix) and not is_gguf(source):
        cls, text_cfg = resolve_text_class(load_config(source), text_model_class)
        sd = text_state_dict(Path(source), cls, text_cfg, strip_prefix=strip_prefix, dtype=dtype)
        return model_from_state_dict(cls, text_cfg, sd, dtype=dtype)
    from transformers import AutoModelForCausalLM

    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, **kw)
    except (OSError, ValueError, KeyError, ImportError) as e:
        raise _wrap("model", source, e) from None
    return model.eval()


def model_from_state_dict(cls, config, state_dict: dict, *, dtype: Any = None):
    """Build `cls(config)` without random initialization, then take `state_dict`'s tensors.

    Built on the CPU (not the meta device) so that non-persistent buffers such as rotary
    ``inv_freq`` are computed by the model itself; ``assign=True`` then swaps the parameters for
    the given tensors instead of copying into them.
    """
    from transformers.initialization import no_init_weights

    with no_init_weights():
        model = cls(config)
    missing, unexpected = model.load_state_dict(state_dict, strict=False, assign=True)
    tied = set(_tied_keys(model))
    missing = [k for k in missing if k not in tied]
    if missing or unexpected:
        raise CorruptFileError(
            f"state dict does not fit {cls.__name__}: missing {missing[:5]}, unexpected {unexpected[:5]}"
        )
    if tied:
        model.tie_weights()
    if dtype is not None:
        model = model.to(dtype)
    return model.eval()


def _tied_keys(model) -> list[str]:
    if not getattr(model.config, "tie_word_embeddings", False):
        return []
    return [k for k in model.state_dict() if k.endswith("lm_head.weight")]


@dataclass(frozen=True)
class SourceIdentity:
    """What a model artifact was made from: recorded in every file derived from it."""

    path: str
    kind: str  # "hf_dir" | "gguf" | "hub"
    sha256: str  # of the GGUF file, or of the checkpoint's config + weight-file hashes

    def to_dict(self) -> dict[str, str]:
        return {"path": self.path, "kind": self.kind, "sha256": self.sha256}


def source_identity(source: str | os.PathLike) -> SourceIdentity:
    p = Path(source)
    if is_gguf(p):
        return SourceIdentity(str(p.resolve()), "gguf", sha256_file(p))
    if p.is_dir():
        h = hashlib.sha256()
        for f in sorted(p.iterdir()):
            if f.is_file() and (f.suffix in (".safetensors", ".json", ".bin") or f.name.endswith(".model")):
                h.update(json.dumps([f.name, sha256_file(f)]).encode())
        return SourceIdentity(str(p.resolve()), "hf_dir", h.hexdigest())
    return SourceIdentity(str(source), "hub", "")


def hf_dir_missing(d: str | os.PathLike) -> list[str]:
    """What an HF checkpoint dir written by ``save_pretrained`` (model, then tokenizer) lacks:
    ``config.json``, the tokenizer's config, the weights (every shard its index names), or a
    weights file cut short (a safetensors file whose size is not what its header says). Empty
    when complete. A directory saved by a run killed midway has ``config.json`` (written first)
    but not the rest."""
    d = Path(d)
    missing: list[str] = []
    for name in ("config.json", "tokenizer_config.json"):
        try:
            json.loads((d / name).read_text(encoding="utf-8"))
        except (OSError, ValueError):
            missing.append(name)
    index = d / "model.safetensors.index.json"
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text(encoding="utf-8"))["weight_map"].values()))
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return missing + [index.name]
    elif (d / "model.safetensors").is_file() or not (d / "pytorch_model.bin").is_file():
        shards = ["model.safetensors"]
    else:
        shards = []  # a legacy pickle: its presence is all that is checked
    missing += [s for s in shards if not _safetensors_whole(d / s)]
    return missing


def _safetensors_whole(p: Path) -> bool:
    """Whether `p` is a safetensors file as long as its header says (8-byte header length, JSON
    header, then the data up to the largest end offset)."""
    try:
        with open(p, "rb") as f:
            n = int.from_bytes(f.read(8), "little")
            header = json.loads(f.read(n))
        size = p.stat().st_size
        ends = [int(v["data_offsets"][1]) for k, v in header.items() if k != "__metadata__"]
    except (OSError, ValueError, TypeError, KeyError, IndexError, AttributeError):
        return False
    return size == 8 + n + max(ends, default=0)


# -- a text model's weights from an HF dir, one tensor at a time (make-teacher, load_model) -----

def _safetensors_files(d: Path) -> list[Path]:
    files = sorted(d.glob("*.safetensors"))
    if not files:
        raise ModelLoadError(f"{d} has no *.safetensors files")
    return files


def _expected_keys(cls, text_cfg) -> tuple[set[str], set[str]]:
    """(state-dict keys of the text model, keys that are tied and may be absent)."""
    import torch

    with torch.device("meta"):
        model = cls(text_cfg)
    keys = set(model.state_dict())
    tied = {k for k in keys if k.endswith("lm_head.weight")} if getattr(text_cfg, "tie_word_embeddings", False) else set()
    return keys, tied


def _map_key(key: str, expected: set[str], strip_prefix: str | None) -> str | None:
    """The text model's name for a checkpoint key, or None when it is not part of it.

    A wrapper's ``model.language_model.layers.0...`` stripped of its prefix is the text backbone's
    ``layers.0...``, which the causal-LM class holds as ``model.layers.0...``.
    """
    if strip_prefix and key.startswith(strip_prefix):
        rest = key[len(strip_prefix):]
        for cand in (rest, f"model.{rest}"):
            if cand in expected:
                return cand
        return None
    return key if key in expected else None


def iter_hf_dir(d: Path, cls, text_cfg, strip_prefix: str | None) -> Iterator[tuple[str, Any]]:
    """(text-model name, float32 tensor) of an HF dir, one tensor in memory at a time."""
    import torch
    from safetensors import safe_open

    expected, tied = _expected_keys(cls, text_cfg)
    seen: set[str] = set()
    for f in _safetensors_files(d):
        with safe_open(str(f), framework="pt") as st:
            for key in st.keys():
                name = _map_key(key, expected, strip_prefix)
                if name is None or name in tied:
                    continue
                seen.add(name)
                yield name, st.get_tensor(key).to(torch.float32)
    missing = sorted(expected - seen - tied)
    if missing:
        hint = "" if strip_prefix else "; a multimodal wrapper needs --strip_prefix (e.g. model.language_model.)"
        raise ModelLoadError(f"{d}: {len(missing)} tensor(s) of {cls.__name__} not found, e.g. {missing[:3]}{hint}")


def text_state_dict(d: Path, cls, text_cfg, *, strip_prefix: str | None, dtype: Any) -> dict[str, Any]:
    return {k: v.to(dtype) for k, v in iter_hf_dir(d, cls, text_cfg, strip_prefix)}
