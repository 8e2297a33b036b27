"""The types stock ``llama-quantize`` writes per tensor for each ftype, reproduced from its rules.

A pure port of ``src/llama-quant.cpp`` at the pinned commit: ``tensor_allows_quantization``
(which tensors are quantized at all), ``llama_ftype_get_default_type``, ``tensor_get_category``,
``llama_tensor_get_type_impl`` (the per-ftype mixture: ``use_more_bits``, the ``i_attention_wv`` /
``i_ffn_down`` / ``i_ffn_gate`` / ``i_ffn_up`` counters, GQA and expert conditions, the
token_embd / output special cases), the ``--pure`` / ``--tensor-type`` / ``--token-embedding-type``
/ ``--output-tensor-type`` paths of ``llama_tensor_get_type``, the row-length fallback
(:func:`voodoo_quant.core.qtypes.resolve_for_row`, ``tensor_type_fallback``) and
``tensor_requires_imatrix``. ``tests/test_recipes.py`` checks it tensor for tensor against the tool.

Public API::

    STOCK_FTYPES                                  # ftype names llama-quantize accepts (our type table)
    RecipeTensor(name, shape, type="F32")         # one GGUF tensor; shape in ggml order (ne0 = row length)
    ModelParams(arch, n_layer, n_head, n_head_kv, n_expert=0)   # GGUF hparams the rules read
    recipe(tensors, params, ftype, *, has_imatrix, pure=False, tensor_types=(),
           token_embedding_type=None, output_tensor_type=None) -> Recipe
    allows_quantization(name, shape, arch="") -> bool           # does the tool quantize it at all
    canonical_ftype(name) -> str                                # "q4_k" -> "Q4_K_M"; RecipeError if unknown

``Recipe.types`` maps every tensor to the type in the output file (tensors the tool does not
quantize keep their source type and are listed in ``Recipe.unquantized``); ``Recipe.needs_imatrix``
names the tensors for which the tool refuses to run without an imatrix. Where the tensor list and
hyper-parameters come from (a GGUF header, an HF config, a run's plans):
:mod:`voodoo_quant.gguf.recipe_inputs`.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..core import qtypes as qt
from ..core.errors import ConfigError

# llama_ftype_get_default_type (src/llama-quant.cpp), for the ftypes of tools/quantize/quantize.cpp
# QUANT_OPTIONS whose types the table knows (Q1_0 / Q2_0 are not in it). "COPY" is not an ftype.
_DEFAULT_TYPE: dict[str, str] = {
    "Q4_0": "Q4_0", "Q4_1": "Q4_1", "MXFP4_MOE": "MXFP4", "Q5_0": "Q5_0", "Q5_1": "Q5_1",
    "IQ2_XXS": "IQ2_XXS", "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_XS", "IQ2_M": "IQ2_S",
    "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0",
    "Q2_K": "Q2_K", "Q2_K_S": "Q2_K", "IQ3_XXS": "IQ3_XXS", "IQ3_S": "IQ3_S", "IQ3_M": "IQ3_S",
    "IQ3_XS": "IQ3_S", "Q3_K_S": "Q3_K", "Q3_K_M": "Q3_K", "Q3_K_L": "Q3_K",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "Q4_K_S": "Q4_K", "Q4_K_M": "Q4_K",
    "Q5_K_S": "Q5_K", "Q5_K_M": "Q5_K", "Q6_K": "Q6_K", "Q8_0": "Q8_0",
    "F16": "F16", "BF16": "BF16", "F32": "F32",
}
STOCK_FTYPES: tuple[str, ...] = tuple(_DEFAULT_TYPE)
_ALIASES = {"Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M", "Q5_K": "Q5_K_M"}  # quantize.cpp QUANT_OPTIONS

_IQ2_FAMILY = ("IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ1_S", "IQ1_M")


class RecipeError(ConfigError):
    """An ftype the tool does not know, or a recipe the tool refuses (it needs an imatrix)."""


@dataclass(frozen=True)
class RecipeTensor:
    name: str  # GGUF tensor name
    shape: tuple[int, ...]  # ggml order: ne0 (row length), ne1 (rows), ne2 (experts), ...
    type: str = "F32"  # its type in the source file


@dataclass(frozen=True)
class ModelParams:
    """The hyper-parameters the rules read, as llama.cpp loads them from the GGUF."""

    arch: str  # general.architecture ("llama", "qwen35", "lfm2", ...)
    n_layer: int  # block_count (hparams.n_layer_all: includes MTP/nextn layers)
    n_head: int  # head_count of layer 0
    n_head_kv: int  # head_count_kv of layer 0 (0 for a recurrent first layer, e.g. LFM2 conv)
    n_expert: int = 0
    n_layer_nextn: int = 0

    @property
    def n_gqa(self) -> int:  # llama_hparams::n_gqa(il = 0)
        return 0 if self.n_head_kv == 0 else self.n_head // self.n_head_kv

    @property
    def is_70b(self) -> bool:
        """model.type == LLM_TYPE_70B (src/models/{llama,qwen2,deci,olmo,jais2}.cpp)."""
        n = self.n_layer - self.n_layer_nextn  # hparams.n_layer()
        if self.arch == "llama":
            return self.n_expert != 8 and n == 80 and self.n_head != self.n_head_kv
        return (self.arch in ("qwen2", "deci", "olmo") and n == 80) or (self.arch == "jais2" and n == 68)


@dataclass(frozen=True)
class Recipe:
    ftype: str
    types: dict[str, str]  # every tensor -> the type llama-quantize writes
    unquantized: tuple[str, ...]  # tensors it copies as they are (1-D, norms, conv, gate_inp, ...)
    fallbacks: dict[str, str] = field(default_factory=dict)  # tensor -> type chosen before the row fallback
    needs_imatrix: tuple[str, ...] = ()  # tensors it will not write without an imatrix


def canonical_ftype(ftype: str) -> str:
    name = str(ftype).upper()
    name = _ALIASES.get(name, name)
    if name not in _DEFAULT_TYPE:
        raise RecipeError(f"unknown llama-quantize ftype {ftype!r}; known: {', '.join(STOCK_FTYPES)}")
    return name


# -- src/llama-quant.cpp, ported ----------------------------------------------------------------

def _n_dims(shape: Sequence[int]) -> int:
    """ggml_n_dims: trailing 1s do not count."""
    n = len(shape)
    while n > 1 and int(shape[n - 1]) == 1:
        n -= 1
    return max(n, 1)


_NOT_QUANTIZED = (  # tensor_allows_quantization: substrings never quantized
    "_norm.weight", "ffn_gate_inp.weight", "ffn_gate_tid2eid.weight", "altup", "laurel",
    "per_layer_model_proj", "ssm_conv1d", "shortconv.conv.weight", "indexer.k_proj.weight",
    "indexer.q_proj.weight", "time_mix_first.weight", "time_mix_w0.weight", "time_mix_w1.weight",
    "time_mix_w2.weight", "time_mix_v0.weight", "time_mix_v1.weight", "time_mix_v2.weight",
    "time_mix_a0.weight", "time_mix_a1.weight", "time_mix_a2.weight", "time_mix_g1.weight",
    "time_mix_g2.weight", "time_mix_decay_w1.weight", "time_mix_decay_w2.weight",
    "time_mix_lerp_fused.weight", "attn_rel_b.weight", ".position_embd", "sam.pos_embd", "sam.neck.",
    "sam.net_", ".rel_pos", ".patch_embd", ".patch_merger", "a.rvq.codebook", "mm.a.code_embd",
)
_NOT_QUANTIZED_GLM5_NEXT = (
    "hc_", "indexer.attn_q_b", "indexer.attn_k", "indexer.proj", "indexer_compressor_gate",
    "indexer_compressor_ape", "ssm_f_a.weight", "ssm_f_b.weight", "ssm_g_a.weight", "ssm_g_b.weight",
    "ssm_beta.weight", "attn_kv_a_mqa.weight", "attn_k_b.weight", "attn_v_b.weight",
)


def allows_quantization(name: str, shape: Sequence[int], arch: str = "") -> bool:
    """tensor_allows_quantization (default params: the output tensor is quantized)."""
    if _n_dims(shape) < 2:
        return False
    # name.rfind("weight") == name.size() - 6 (size_t: a 5-character name compares npos == npos)
    if not (name.endswith("weight") or len(name) == 5):
        return False
    if any(s in name for s in _NOT_QUANTIZED):
        return False
    if name in ("position_embd.weight", "token_types.weight"):
        return False
    return not (arch == "glm5-next" and any(s in name for s in _NOT_QUANTIZED_GLM5_NEXT))


def category(name: str) -> str:
    """tensor_get_category: the first substring test that matches, in the C order."""
    if name == "output.weight":
        return "output"
    if name in ("token_embd.weight", "per_layer_token_embd.weight"):
        return "token_embd"
    for key, cat in (("attn_qkv.weight", "attn_qkv"), ("attn_kv_b.weight", "attn_kv_b"),
                     ("attn_v.weight", "attn_v"), ("attn_k.weight", "attn_k"), ("attn_q.weight", "attn_q"),
                     ("attn_output.weight", "attn_output"), ("ffn_up", "ffn_up"), ("ffn_gate", "ffn_gate"),
                     ("ffn_down", "ffn_down")):
        if key in name:
            return cat
    return "other"


_ATTN_V_LIKE = ("attn_v", "attn_qkv", "attn_kv_b")  # category_is_attn_v
_BLK = re.compile(r"blk\.\s*([+-]?\d+)")


def _blk(name: str) -> int:
    """sscanf(name, "blk.%d.", &layer), -1 when it does not match."""
    m = _BLK.match(name)
    return int(m.group(1)) if m else -1


def _use_more_bits(i: int, n: int) -> bool:
    return i < n // 8 or i >= 7 * n // 8 or (i - n // 8) % 3 == 2


class _State:  # quantize_state_impl: the counters
    def __init__(self, names: Iterable[str], p: ModelParams, has_imatrix: bool):
        self.p, self.has_imatrix = p, has_imatrix
        cats = [category(n) for n in names]
        self.n_attention_wv = sum(c in _ATTN_V_LIKE for c in cats)
        self.tied = "output" not in cats
        self.n_ffn = p.n_layer
        self.i_attention_wv = self.i_ffn_down = self.i_ffn_gate = self.i_ffn_up = 0
        self.output_type: str | None = None  # --output-tensor-type (also for a tied token_embd)

    def layer(self, counter: int, name: str) -> tuple[int, int]:
        if max(1, self.p.n_expert) > 1:  # experts are not consecutive: parse the name
            i = _blk(name)
            if i < 0 or i >= self.n_ffn:
                raise RecipeError(f"cannot determine the layer of tensor {name} (n_layer {self.n_ffn})")
            return i, self.n_ffn
        return counter, self.n_ffn


def _mixture(s: _State, t: str, name: str, shape: Sequence[int], ftype: str, cat: str) -> str:
    """llama_tensor_get_type_impl: `t` is the ftype's default type."""
    p, arch = s.p, s.p.arch
    if arch == "glm5-next" and any(k in name for k in ("attn_q_a", "attn_q_b", "nextn.eh_proj")):
        if t not in ("F32", "BF16", "F16"):
            return "Q8_0"
    if cat == "output" or (s.tied and cat == "token_embd"):
        if s.output_type:
            return s.output_type
        if ftype == "MXFP4_MOE" or arch == "falcon" or int(shape[0]) % qt.get(t).block:
            return "Q8_0"
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ3_XXS", "IQ1_S", "IQ2_S", "IQ2_M", "IQ1_M"):
            return "Q5_K"
        return t if t == "Q8_0" else "Q6_K"
    if ftype == "MXFP4_MOE":
        expert_role = cat in ("ffn_up", "ffn_gate", "ffn_down")
        ne2 = int(shape[2]) if len(shape) > 2 else 1
        return "MXFP4" if ne2 > 1 and (arch != "bailingmoe3" or expert_role) else "Q8_0"
    if cat == "token_embd":
        if ftype in ("IQ2_XXS", "IQ2_XS", "IQ1_S", "IQ1_M"):
            return "Q2_K"
        if ftype in ("IQ2_S", "IQ2_M", "IQ3_XXS"):
            return "IQ3_S"
        if ftype in ("TQ1_0", "TQ2_0", "Q2_0"):
            return "Q4_K"
        return t
    if ftype in _IQ2_FAMILY:
        iq2s = ftype in ("IQ2_S", "IQ2_M")
        if cat in _ATTN_V_LIKE:
            t = "Q4_K" if (p.n_gqa >= 4 or p.n_expert >= 4) else ("IQ3_S" if iq2s else "Q2_K")
            s.i_attention_wv += 1
        elif p.n_expert == 8 and cat == "attn_k":
            t = "Q4_K"
        elif cat == "ffn_down":
            if s.i_ffn_down < s.n_ffn // 8:
                t = "IQ3_S" if iq2s else "Q2_K"
            s.i_ffn_down += 1
        elif cat == "attn_output":
            if p.n_expert == 8:
                t = "Q5_K"
            elif ftype in ("IQ1_S", "IQ1_M"):
                t = "IQ2_XXS"
            elif iq2s:
                t = "IQ3_S"
        return t
    if cat in _ATTN_V_LIKE:
        gqa4 = p.n_gqa >= 4
        if ftype == "Q2_K":
            t = "Q4_K" if gqa4 else "Q3_K"
        elif ftype == "Q2_K_S" and gqa4:
            t = "Q4_K"
        elif ftype == "IQ3_XXS":
            t = "Q4_K" if gqa4 else ("IQ3_S" if not s.has_imatrix else "IQ3_XXS")
        elif ftype in ("IQ3_XS", "IQ3_S") and gqa4:
            t = "Q4_K"
        elif ftype == "IQ3_M":
            t = "Q4_K"
        elif ftype == "Q3_K_M":
            t = "Q5_K" if s.i_attention_wv < 2 else "Q4_K"
        elif ftype == "Q3_K_L":
            t = "Q5_K"
        elif ftype in ("IQ4_NL", "IQ4_XS") and gqa4:
            t = "Q5_K"
        elif ftype in ("Q4_K_M", "Q5_K_M") and _use_more_bits(s.i_attention_wv, s.n_attention_wv):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and s.i_attention_wv < 4:
            t = "Q5_K"
        if p.is_70b and t in ("Q3_K", "Q4_K"):
            t = "Q5_K"
        if p.n_expert == 8:
            t = "Q8_0"
        s.i_attention_wv += 1
    elif cat == "attn_k":
        if p.n_expert == 8:
            t = "Q8_0"
        elif ftype == "IQ3_XS":
            t = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            t = "IQ2_S"
    elif cat == "attn_q":
        if ftype == "IQ3_XS":
            t = "IQ3_XXS"
        elif ftype == "IQ3_XXS":
            t = "IQ2_S"
    elif cat == "ffn_down":
        i, n = s.layer(s.i_ffn_down, name)
        falcon = arch == "falcon"
        if ftype == "Q2_K":
            t = "Q3_K"
        elif ftype == "Q2_K_S":
            if i < n // 8:
                t = "Q4_K"
        elif ftype == "IQ3_XXS" and not s.has_imatrix:
            t = "Q4_K" if i < n // 8 else "Q3_K"
        elif ftype == "Q3_K_M":
            t = "Q5_K" if i < n // 16 else ("Q4_K" if not falcon or _use_more_bits(i, n) else "Q3_K")
        elif ftype == "IQ3_M" and (i < n // 8 or (p.n_expert == 8 and _use_more_bits(i, n))):
            t = "Q4_K"
        elif ftype == "Q3_K_L":
            t = "Q4_K" if falcon else "Q5_K"
        elif ftype == "Q4_K_M":
            if falcon:
                t = "Q6_K" if i < n // 16 else ("Q5_K" if _use_more_bits(i, n) else "Q4_K")
            elif _use_more_bits(i, n):
                t = "Q6_K"
        elif i < n // 8 and ftype in ("IQ4_NL", "IQ4_XS") and not s.has_imatrix:
            t = "Q5_K"
        elif ftype == "Q5_K_M" and _use_more_bits(i, n):
            t = "Q6_K"
        elif ftype == "Q4_K_S" and not falcon and i < n // 8:
            t = "Q5_K"
        elif ftype in ("Q4_0", "Q5_0") and s.has_imatrix and i < n // 8:
            t = "Q4_1" if ftype == "Q4_0" else "Q5_1"  # guard the first ffn_down layers
        s.i_ffn_down += 1
    elif cat == "attn_output":
        if arch != "falcon":
            if p.n_expert == 8:
                if ftype in ("Q2_K", "IQ3_XS", "IQ3_XXS", "Q3_K_S", "Q3_K_M", "IQ4_NL", "Q4_K_S", "Q4_K_M",
                             "IQ3_S", "IQ3_M", "IQ4_XS"):
                    t = "Q5_K"
            else:
                t = {"Q2_K": "Q3_K", "IQ3_XXS": "IQ3_S", "Q3_K_M": "Q4_K", "Q3_K_L": "Q5_K",
                     "IQ3_M": "Q4_K"}.get(ftype, t)
        elif ftype == "Q3_K_L":
            t = "Q4_K"
    elif cat in ("ffn_gate", "ffn_up"):
        counter = s.i_ffn_gate if cat == "ffn_gate" else s.i_ffn_up
        i, n = s.layer(counter, name)
        if ftype == "IQ3_XS" and n // 8 <= i < 7 * n // 8:
            t = "IQ3_XXS"
        if cat == "ffn_gate":
            s.i_ffn_gate += 1
        else:
            s.i_ffn_up += 1
    return t


def _requires_imatrix(name: str, t: str, ftype: str) -> bool:
    """tensor_requires_imatrix."""
    if category(name) in ("token_embd", "output"):
        return False
    if t == "Q2_K":
        return ftype == "Q2_K_S"
    return qt.get(t).needs_imatrix


def recipe(
    tensors: Sequence[RecipeTensor],
    params: ModelParams,
    ftype: str,
    *,
    has_imatrix: bool,
    pure: bool = False,
    tensor_types: Sequence[tuple[str, str]] = (),
    token_embedding_type: str | None = None,
    output_tensor_type: str | None = None,
) -> Recipe:
    """The type llama-quantize writes for every tensor of a model quantized to `ftype`.

    `tensor_types` are ``--tensor-type`` (or ``--tensor-type-file``) entries ``(regex, type)``, first
    match wins; `pure`, `token_embedding_type` and `output_tensor_type` are the flags of those names.
    """
    ftype = canonical_ftype(ftype)
    default = _DEFAULT_TYPE[ftype]
    patterns = [(re.compile(pat.lower()), qt.get(typ).name) for pat, typ in tensor_types]
    emb_t = qt.get(token_embedding_type).name if token_embedding_type else None
    out_t = qt.get(output_tensor_type).name if output_tensor_type else None
    # llama_model_loader.weights_map order: by layer (non-block tensors first), then by name.
    order = sorted(tensors, key=lambda x: (_blk(x.name), x.name.encode()))
    s = _State([x.name for x in order], params, has_imatrix)
    s.output_type = out_t
    types: dict[str, str] = {}
    unquantized: list[str] = []
    fallbacks: dict[str, str] = {}
    needs: list[str] = []
    for x in order:
        src = qt.get(x.type).name
        if not allows_quantization(x.name, x.shape, params.arch):
            types[x.name] = src
            unquantized.append(x.name)
            continue
        cat = category(x.name)
        t = default
        if emb_t and cat == "token_embd" and not (
            x.name == "per_layer_token_embd.weight" and any(r.search(x.name) for r, _ in patterns)
        ):
            t = emb_t
        elif out_t and cat == "output":
            t = out_t
        elif not qt.get(default).is_float:
            manual = next((typ for r, typ in patterns if r.search(x.name)), None)
            if manual is not None:
                t = manual
            elif not pure:
                t = _mixture(s, default, x.name, x.shape, ftype, cat)
            served = qt.resolve_for_row(t, int(x.shape[0])).name  # tensor_type_fallback
            if served != t:
                fallbacks[x.name] = t
            t = served
        types[x.name] = t
        if _requires_imatrix(x.name, t, ftype):  # checked whether or not the type changes
            needs.append(x.name)
    return Recipe(ftype, {x.name: types[x.name] for x in tensors}, tuple(unquantized), fallbacks, tuple(needs))
