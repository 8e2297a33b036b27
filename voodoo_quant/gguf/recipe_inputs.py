"""The inputs of :func:`voodoo_quant.gguf.recipes.recipe`, from what a user has: a GGUF header, an HF
config, or a run's tensor plans.

Public API::

    gguf_inputs(path) -> (list[RecipeTensor], ModelParams)      # from an F32/F16/BF16 GGUF
    config_params(config) -> ModelParams                        # from an HF config
    stock_types(plans, config, ftype, has_imatrix, *, pure=False) -> {hf_name: qtype}

``stock_types`` raises :class:`~voodoo_quant.gguf.recipes.RecipeError` when the tool would refuse the
ftype without an imatrix.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Sequence

from ..core import qtypes as qt
from ..core.errors import CorruptFileError
from .header import read_file
from .recipes import ModelParams, RecipeError, RecipeTensor, recipe

def _first(v: Any) -> int:
    return int(v[0] if isinstance(v, (list, tuple)) else v)


def gguf_inputs(path: str | Path) -> tuple[list[RecipeTensor], ModelParams]:
    """The tensor list and hyper-parameters of a GGUF model file, read from its header only
    (checked by :func:`~voodoo_quant.gguf.header.read_file`: what gguf.cpp refuses, or tensor data
    past the end of the file, is a :class:`CorruptFileError` naming the file)."""
    path = Path(path)
    kv, infos, _ = read_file(path, "GGUF file")  # every refusal a CorruptFileError naming the file
    arch = kv.get("general.architecture")
    if not isinstance(arch, str):
        raise CorruptFileError(f"{path}: GGUF has no general.architecture")

    def num(k: str, default: Any = None) -> int:
        """The count at key ``<arch>.<k>`` (the first of a per-layer array), refused by name when it
        is missing (no `default`) or not a count."""
        v = kv.get(f"{arch}.{k}", default)
        if v is None:
            raise CorruptFileError(f"{path}: GGUF has no {arch}.{k}")
        try:
            n = _first(v)
        except (TypeError, ValueError, IndexError):
            n = -1
        if n < 0 or isinstance(v, (str, bytes)):
            raise CorruptFileError(f"{path}: GGUF key {arch}.{k} is {str(v)[:80]!r}, not a count")
        return n

    n_head = num("attention.head_count", 0)
    n_expert = num("expert_count", 0)
    params = ModelParams(
        arch=arch, n_layer=num("block_count"), n_head=n_head,
        n_head_kv=num("attention.head_count_kv", n_head),  # optional: defaults to n_head
        n_expert=n_expert if n_expert > 1 else 0, n_layer_nextn=num("nextn_predict_layers", 0),
    )
    tensors = [RecipeTensor(name, tuple(int(d) for d in ne), qt.by_id(gtype).name) for name, ne, gtype, _ in infos]
    return tensors, params


# HF model_type -> GGUF architecture (src/llama-arch.cpp LLM_ARCH_NAMES): the shipped ones and those
# the rules test by name (falcon, the 70B types); any other keeps its model_type, which no rule reads.
_ARCH = {"falcon": "falcon", "llama": "llama", "mistral": "llama", "qwen2": "qwen2", "olmo": "olmo",
         "nemotron-nas": "deci", "jais2": "jais2", "qwen3": "qwen3", "qwen3_5": "qwen35",
         "qwen3_5_text": "qwen35", "lfm2": "lfm2"}


def config_params(config: Any) -> ModelParams:
    """:class:`ModelParams` from an HF config (object or dict), as the converter writes them
    (``conversion/base.py`` set_gguf_parameters; LFM2 writes head_count_kv 0 for conv layers).
    MTP layers are not counted: voodoo converts with ``--no-mtp``."""
    if hasattr(config, "get_text_config"):
        config = config.get_text_config()
    c = config.to_dict() if hasattr(config, "to_dict") else dict(config)
    c = {**c, **c.get("text_config", {})} if isinstance(c.get("text_config"), dict) else c

    def find(*keys: str, default: Any = None) -> Any:
        return next((c[k] for k in keys if c.get(k) is not None), default)

    n_layer = find("n_layers", "num_hidden_layers", "n_layer", "num_layers")
    n_head = find("num_attention_heads", "n_head", "n_heads")
    if n_layer is None or n_head is None:
        raise RecipeError("the model config has no layer or head count (num_hidden_layers, num_attention_heads)")
    n_head_kv = find("num_key_value_heads", "n_kv_heads", default=n_head)
    mt = str(c.get("model_type", ""))
    layer0 = (c.get("layer_types") or [None])[0]
    if mt == "lfm2" and layer0 == "conv":
        n_head_kv = 0
    elif mt == "lfm2_moe" and layer0 != "full_attention":
        n_head_kv = 0
    n_expert = int(find("num_local_experts", "num_experts", "n_routed_experts", default=0))
    return ModelParams(_ARCH.get(mt, mt), int(n_layer), _first(n_head), _first(n_head_kv),
                       n_expert if n_expert > 1 else 0)


def stock_types(
    plans: Sequence[Any], config: Any, ftype: str, has_imatrix: bool, *, pure: bool = False
) -> dict[str, str]:
    """{HF tensor name: type} stock llama-quantize writes for each plan (``TensorPlan`` with
    ``.name``, ``.gguf_name``, ``.rows``, ``.n_per_row``) of a model quantized to `ftype`.

    The rules count attn_v-like and ffn tensors in file order: plans must hold every such tensor
    (they do for the shipped architectures; ``tests/test_recipes.py`` checks them against the
    GGUF). Raises :class:`RecipeError` when the tool would refuse the ftype without an imatrix.
    """
    params = config_params(config)
    tensors, hf = [], {}
    for p in plans:
        if not p.gguf_name:
            raise RecipeError(f"tensor {p.name} has no GGUF name: llama.cpp's converter does not map it")
        tensors.append(RecipeTensor(p.gguf_name, (int(p.n_per_row), int(p.rows))))
        hf[p.gguf_name] = p.name
    tied = getattr(config, "tie_word_embeddings", None)
    if isinstance(config, dict):
        tied = config.get("tie_word_embeddings")
    if tied is False and "output.weight" not in hf:  # an untied head the plans do not select
        tensors.append(RecipeTensor("output.weight", (1, 1)))
    r = recipe(tensors, params, ftype, has_imatrix=has_imatrix, pure=pure)
    if r.needs_imatrix and not has_imatrix:
        raise RecipeError(f"llama-quantize refuses {r.ftype} without an imatrix (tensor {r.needs_imatrix[0]} "
                          f"would be {r.types[r.needs_imatrix[0]]})")
    return {hf[g]: r.types[g] for g in hf}
