"""recipes.py's per-tensor types vs what stock ``llama-quantize`` writes, tensor for tensor.

Tiny random models (SmolLM2 tokenizer) of each shipped architecture are converted by llama.cpp's
own ``convert_hf_to_gguf.py``; an imatrix comes from stock ``llama-imatrix``; every ftype the tool
accepts is run and the types of its output GGUF are compared with the prediction. Widths 576,
640 and 896 (not multiples of 256; one row length not even a multiple of 32) exercise the
row-length fallback, and the menus' resolution (``menus.build_menu``) is checked against the
types the tool writes under ``--tensor-type-file`` and ``--pure``.
"""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from voodoo_quant.core import paths
from voodoo_quant.core import qtypes as qt
from voodoo_quant.gguf import recipe_inputs, recipes
from voodoo_quant.gguf.converter import convert
from voodoo_quant.selection import menus

# The ftypes of the brief, plus the other ones the tool accepts that the type table knows.
FTYPES = ("Q2_K", "Q2_K_S", "Q3_K_S", "Q3_K_M", "Q3_K_L", "Q4_0", "Q4_1", "Q4_K_S", "Q4_K_M", "Q5_0",
          "Q5_1", "Q5_K_S", "Q5_K_M", "Q6_K", "Q8_0", "IQ2_XXS", "IQ2_XS", "IQ2_S", "IQ2_M", "IQ3_XXS",
          "IQ3_XS", "IQ3_S", "IQ3_M", "IQ4_NL", "IQ4_XS", "IQ1_S", "IQ1_M", "MXFP4_MOE", "TQ1_0", "TQ2_0",
          "F16", "BF16")
assert set(FTYPES) | {"F32"} == set(recipes.STOCK_FTYPES)
# The ftypes whose rules read whether an imatrix is given, and some the tool refuses without one.
IMATRIX_SENSITIVE = ("Q4_0", "Q5_0", "IQ3_XXS", "IQ4_NL", "IQ4_XS")
_REFUSED_WITHOUT = ("IQ2_XXS", "IQ1_M", "Q2_K_S", "IQ2_M")

# hidden 256 (K-quants fit), enough layers that n/8, n/16 and use_more_bits pick distinct layers.
ARCHS = {
    # tied, small: the model every ftype is really quantized on (IQ1_S costs ~0.4 M weights/s)
    "llama": ("LlamaConfig", "LlamaForCausalLM", dict(
        hidden_size=256, intermediate_size=256, num_hidden_layers=3, num_attention_heads=4,
        num_key_value_heads=1, head_dim=64, tie_word_embeddings=True)),
    # untied (output.weight present), GQA 4, 16 layers: Q3_K_M's first sixteenth, use_more_bits
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=16, num_attention_heads=8,
        num_key_value_heads=2, head_dim=64, tie_word_embeddings=False)),
    # hybrid, GQA 2: linear-attention attn_qkv counts as attn_v-like
    "qwen3_5": ("Qwen3_5TextConfig", "Qwen3_5ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=8, num_attention_heads=4,
        num_key_value_heads=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
        linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True,
        layer_types=(["linear_attention"] * 3 + ["full_attention"]) * 2)),
    # the first layer is a conv layer: head_count_kv[0] = 0, so n_gqa() = 0
    "lfm2": ("Lfm2Config", "Lfm2ForCausalLM", dict(
        hidden_size=256, intermediate_size=512, num_hidden_layers=6, num_attention_heads=4,
        num_key_value_heads=2, layer_types=["conv", "conv", "full_attention", "conv", "full_attention", "conv"])),
}
# hidden -> (intermediate, heads, kv heads) of a tied 4-layer Llama: rows of 576/640/896 take only
# 32-block types; ffn_down rows of 1536 take 256-block ones, 1728 only 32-block ones, 1000 none (F16).
WIDTHS = {576: (1536, 9, 3), 640: (1728, 10, 2), 896: (1000, 14, 2)}


def _spec(key):
    if isinstance(key, int):
        ffn, heads, kv = WIDTHS[key]
        return ("LlamaConfig", "LlamaForCausalLM", dict(
            hidden_size=key, intermediate_size=ffn, num_hidden_layers=4, num_attention_heads=heads,
            num_key_value_heads=kv, head_dim=64, tie_word_embeddings=True))
    return ARCHS[key]


def _build(d, tok_dir, cls_cfg: str, cls_model: str, kw: dict, seed: int = 7):
    import torch
    import transformers

    torch.manual_seed(seed)
    cfg = getattr(transformers, cls_cfg)(vocab_size=49152, max_position_embeddings=512, bos_token_id=1,
                                         eos_token_id=2, **kw)
    getattr(transformers, cls_model)(cfg).save_pretrained(d)
    for f in tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    return d


class _Model:
    """A converted tiny model, its stock imatrix, its tensor list and hyper-parameters."""

    def __init__(self, d, tok_dir, text, key):
        self.hf = d / "hf"
        self.hf.mkdir()
        _build(self.hf, tok_dir, *_spec(key))
        # the wide models as F16 (half the bytes each llama-quantize run loads and checks)
        outtype = "f16" if isinstance(key, int) else "f32"
        self.gguf = convert(self.hf, d / f"model-{outtype}.gguf", outtype=outtype)
        self.imatrix = d / "imatrix.gguf"
        cmd = [str(paths.tool_path("llama-imatrix")), "-m", str(self.gguf), "-f", str(text), "-o",
               str(self.imatrix), "-c", "128", "--chunks", "2", "-t", "2", "-ngl", "0"]
        p = subprocess.run(cmd, capture_output=True, text=True)
        assert p.returncode == 0 and self.imatrix.is_file(), p.stderr[-3000:]
        self.tensors, self.params = recipe_inputs.gguf_inputs(self.gguf)

    def quantize(self, out, ftype, *, imatrix: bool, extra=()):
        cmd = [str(paths.tool_path("llama-quantize")), *extra]
        if imatrix:
            cmd += ["--imatrix", str(self.imatrix)]
        cmd += [str(self.gguf), *([] if out is None else [str(out)]), ftype, "2"]
        return subprocess.run(cmd, capture_output=True, text=True)

    def dry_run(self, ftype, *, imatrix: bool, extra=()) -> tuple[dict[str, str], bool]:
        """({tensor: type} as the tool reports it, whether it says an imatrix is required)."""
        p = self.quantize(None, ftype, imatrix=imatrix, extra=["--dry-run", *extra])
        assert p.returncode == 0, (ftype, (p.stderr or p.stdout)[-2000:])
        log = p.stdout + p.stderr
        types = {m[1]: qt.get(m[3] or m[2]).name for m in _LOG_LINE.finditer(log)}
        assert len(types) == len(self.tensors), f"{ftype}: parsed {len(types)} of {len(self.tensors)} tensors"
        return types, "will require an imatrix" in log


# src/llama-quant.cpp main loop: "[  i/  n] name - [shape], type = src, size = a MiB[ -> b MiB (new)]"
_LOG_LINE = re.compile(r"^\[\s*\d+/\s*\d+\]\s+(\S+)\s+- \[[^\]]*\], type =\s*(\S+), "
                       r"size =\s*[\d.]+ MiB(?: ->\s*[\d.]+ MiB \((\S+)\))?", re.M)


@pytest.fixture(scope="session")
def recipe_models(tmp_path_factory, smollm2_tok_dir, shakespeare_text_file):
    """key (arch name or width) -> _Model, built on first use and shared by every test here."""
    cache: dict = {}

    def get(key):
        if key not in cache:
            cache[key] = _Model(tmp_path_factory.mktemp(f"recipes_{key}"), smollm2_tok_dir, shakespeare_text_file, key)
        return cache[key]

    return get


def _written(path) -> dict[str, str]:
    tensors, _ = recipe_inputs.gguf_inputs(path)
    path.unlink()
    return {t.name: t.type for t in tensors}


def _diff(got: dict, want: dict) -> str:
    bad = [f"{k}: tool {got.get(k)} predicted {want.get(k)}" for k in sorted(set(got) | set(want))
           if got.get(k) != want.get(k)]
    return "; ".join(bad[:12]) + (f" (+{len(bad) - 12} more)" if len(bad) > 12 else "")


# -- every ftype, every architecture ------------------------------------------------------------

@pytest.mark.slow
def test_written_types_match_for_every_ftype(recipe_models, tmp_path):
    """Every ftype really quantized: the output GGUF's types == the prediction == the dry run's
    report (which makes the dry run a valid oracle for the wider matrix below)."""
    m = recipe_models("llama")
    seen = set()
    for ftype in FTYPES:
        for has_im in (True, False) if ftype in IMATRIX_SENSITIVE + _REFUSED_WITHOUT else (True,):
            want = recipes.recipe(m.tensors, m.params, ftype, has_imatrix=has_im)
            out = tmp_path / f"{ftype}.gguf"
            p = m.quantize(out, ftype, imatrix=has_im)
            if want.needs_imatrix and not has_im:
                assert p.returncode != 0 and "requires an imatrix" in p.stdout + p.stderr, ftype
                continue
            assert p.returncode == 0, (ftype, (p.stderr or p.stdout)[-2000:])
            got = _written(out)
            assert got == want.types, f"{ftype} imatrix={has_im}: {_diff(got, want.types)}"
            assert m.dry_run(ftype, imatrix=has_im)[0] == got, ftype
            seen.update(got.values())
    # not vacuous: the recipes really mix types and leave the norms alone
    assert {"Q2_K", "Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0", "IQ1_S", "IQ2_XXS", "IQ3_S", "F32"} <= seen


def _check_matrix(m: _Model) -> set[str]:
    fell = set()
    for ftype in FTYPES:
        for has_im in (True, False) if ftype in IMATRIX_SENSITIVE + _REFUSED_WITHOUT else (True,):
            want = recipes.recipe(m.tensors, m.params, ftype, has_imatrix=has_im)
            got, needs = m.dry_run(ftype, imatrix=has_im)
            assert got == want.types, f"{ftype} imatrix={has_im}: {_diff(got, want.types)}"
            assert needs == bool(want.needs_imatrix and not has_im), (ftype, has_im, want.needs_imatrix)
            fell.update(want.fallbacks)
    return fell


@pytest.mark.slow
@pytest.mark.parametrize("arch", list(ARCHS))
def test_every_ftype_matches_the_tool(recipe_models, arch):
    m = recipe_models(arch)
    assert not _check_matrix(m)  # hidden 256: nothing falls back
    assert any(t.name.endswith("_norm.weight") for t in m.tensors)


@pytest.mark.slow
@pytest.mark.parametrize("width", list(WIDTHS))
def test_fallback_widths_match_the_tool(recipe_models, width):
    fell = _check_matrix(recipe_models(width))
    assert {"blk.0.attn_q.weight", "token_embd.weight"} <= fell


def test_per_ftype_rules_read_the_counters():
    """Without the tool: the rules that hinge on layer counters and GQA pick what llama-quant.cpp says
    (hand-checked against its source); the slow tests check the same against the tool."""
    ts = [recipes.RecipeTensor("token_embd.weight", (256, 1000)), recipes.RecipeTensor("output_norm.weight", (256,))]
    for i in range(16):
        ts += [recipes.RecipeTensor(f"blk.{i}.attn_v.weight", (256, 128)),
               recipes.RecipeTensor(f"blk.{i}.ffn_down.weight", (512, 256)),
               recipes.RecipeTensor(f"blk.{i}.attn_norm.weight", (256,))]
    p = recipes.ModelParams("llama", 16, 4, 2)
    r = recipes.recipe(ts, p, "Q4_K_M", has_imatrix=False)
    more = [i for i in range(16) if r.types[f"blk.{i}.ffn_down.weight"] == "Q6_K"]
    assert more == [0, 1, 4, 7, 10, 13, 14, 15]  # use_more_bits(i, 16)
    assert r.types["token_embd.weight"] == "Q6_K" and "blk.3.attn_norm.weight" in r.unquantized
    r = recipes.recipe(ts, p, "Q3_K_M", has_imatrix=False)
    assert [r.types[f"blk.{i}.attn_v.weight"] for i in range(3)] == ["Q5_K", "Q5_K", "Q4_K"]
    assert r.types["blk.0.ffn_down.weight"] == "Q5_K" and r.types["blk.1.ffn_down.weight"] == "Q4_K"
    gqa4 = recipes.ModelParams("llama", 16, 8, 2)
    assert recipes.recipe(ts, gqa4, "Q2_K", has_imatrix=True).types["blk.5.attn_v.weight"] == "Q4_K"
    assert recipes.recipe(ts, p, "Q2_K", has_imatrix=True).types["blk.5.attn_v.weight"] == "Q3_K"
    assert recipes.recipe(ts, p, "IQ2_XXS", has_imatrix=False).needs_imatrix
    with pytest.raises(recipes.RecipeError):
        recipes.recipe(ts, p, "Q9_X", has_imatrix=False)


# -- the menus' resolution vs the tool -----------------------------------------------------------

def _rotations(m: _Model, types: list[str]) -> list[dict[str, str]]:
    """--tensor-type assignments that put every type on every row length of the model's quantizable
    tensors (token_embd left to the ftype: it is the largest tensor and shares the hidden width)."""
    groups: dict[int, list[str]] = {}
    for t in m.tensors:
        if recipes.allows_quantization(t.name, t.shape, m.params.arch) and t.name != "token_embd.weight":
            groups.setdefault(int(t.shape[0]), []).append(t.name)
    n_runs = max(-(-len(types) // len(g)) for g in groups.values())
    runs = []
    for k in range(n_runs):
        runs.append({n: types[(k * len(g) + i) % len(types)] for g in groups.values() for i, n in enumerate(g)})
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("width", list(WIDTHS))
def test_menu_resolution_matches_the_tool(recipe_models, tmp_path, width):
    """Each menu type at each row length, as export passes it (--tensor-type-file).
    The first assignment (every type on the hidden-width rows) is written and read back at 640 and
    896; the others, and 576 (whose 1536-long rows take every IQ type, each costing seconds of grid
    setup per process), use the tool's dry-run report, shown equal to the written file above."""
    m = recipe_models(width)
    row = {t.name: int(t.shape[0]) for t in m.tensors}
    types = list(qt.MENU_TYPES)
    checked: set[tuple[str, int]] = set()
    for k, assign in enumerate(_rotations(m, types)):
        tt = tmp_path / "types.txt"
        tt.write_text("".join(f"{n}={t}\n" for n, t in assign.items()))
        if width == 576 or k > 0:
            got, _ = m.dry_run("Q8_0", imatrix=True, extra=["--tensor-type-file", str(tt)])
        else:
            out = tmp_path / f"tt{k}.gguf"
            p = m.quantize(out, "Q8_0", imatrix=True, extra=["--tensor-type-file", str(tt)])
            assert p.returncode == 0, p.stderr[-2000:]
            got = _written(out)
        want = recipes.recipe(m.tensors, m.params, "Q8_0", has_imatrix=True, tensor_types=list(assign.items()))
        assert got == want.types, _diff(got, want.types)
        for name, t in assign.items():
            served = menus.build_menu([t], row[name], has_imatrix=True).types
            assert served == (got[name],), f"{name} (rows of {row[name]}) {t}: tool {got[name]}, menu {served}"
            checked.add((t, row[name]))
    assert checked == {(t, r) for t in types for r in {row[n] for n in assign}}  # every type, every row length


@pytest.mark.slow
def test_pure_menu_types_match_the_tool(recipe_models):
    """--pure: every quantizable tensor takes the ftype's own type, through the fallback."""
    m = recipe_models(576)
    ftype_of = {}
    for f in FTYPES:
        ftype_of.setdefault(recipes._DEFAULT_TYPE[f], f)
    for t in qt.MENU_TYPES:
        ftype = ftype_of[t]
        want = recipes.recipe(m.tensors, m.params, ftype, has_imatrix=True, pure=True)
        got, _ = m.dry_run(ftype, imatrix=True, extra=["--pure"])
        assert got == want.types, f"--pure {ftype}: {_diff(got, want.types)}"
        for x in m.tensors:
            if x.name not in want.unquantized:
                assert menus.build_menu([t], x.shape[0], has_imatrix=True).types == (got[x.name],), (t, x.name)


@pytest.mark.slow
@pytest.mark.parametrize("width", list(WIDTHS))
def test_menu_drops_what_the_tool_refuses_without_imatrix(recipe_models, width):
    """build_menu(has_imatrix=False) drops exactly the types the tool will not write without one."""
    m = recipe_models(width)
    one_per_row = {}
    for x in m.tensors:
        if recipes.allows_quantization(x.name, x.shape, m.params.arch) and x.name != "token_embd.weight":
            one_per_row.setdefault(int(x.shape[0]), x.name)
    refusals = 0
    for t in qt.MENU_TYPES:
        for n_per_row, name in one_per_row.items():
            menu = menus.build_menu([t], n_per_row, has_imatrix=False)
            _, refused = m.dry_run("Q8_0", imatrix=False, extra=["--tensor-type", f"{name}={t}"])
            assert refused == (menu.types == ()), (t, name, n_per_row, menu)
            refusals += refused
    assert refusals == (6 if width == 576 else 0)  # six IQ types need one; they fit only 1536-long rows


# -- the lead's entry point: plans + HF config ----------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("key", [*ARCHS, 576])
def test_stock_types_from_plans_equal_the_gguf_prediction(recipe_models, key):
    """stock_types(plans, config) sees only the selectable tensors and the HF config; it must give
    what recipe() gives from the converted GGUF (tested against the tool above), for every ftype."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from voodoo_quant.arch import adapter_for
    from voodoo_quant.selection.menus import MenuConfig
    from voodoo_quant.student.build import converter_layouts, plan_model

    m = recipe_models(key)
    model = AutoModelForCausalLM.from_pretrained(m.hf)
    plans = plan_model(model, adapter_for(model.config), MenuConfig(("Q8_0",)),
                       layout_for=converter_layouts(str(m.hf)))
    assert recipe_inputs.config_params(AutoConfig.from_pretrained(m.hf)) == m.params
    quantizable = {t.name for t in m.tensors if recipes.allows_quantization(t.name, t.shape, m.params.arch)}
    assert {p.gguf_name for p in plans} == quantizable  # every tensor the tool quantizes is selectable
    for ftype in FTYPES:
        for has_im in (True, False):
            ref = recipes.recipe(m.tensors, m.params, ftype, has_imatrix=has_im)
            if ref.needs_imatrix and not has_im:
                with pytest.raises(recipes.RecipeError, match="without an imatrix"):
                    recipe_inputs.stock_types(plans, model.config, ftype, has_im)
                continue
            got = recipe_inputs.stock_types(plans, model.config, ftype, has_im)
            assert got == {p.name: ref.types[p.gguf_name] for p in plans}, (key, ftype, has_im)
