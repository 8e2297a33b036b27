"""Menus: llama.cpp fallbacks for the row length, imatrix drops, rung order, --tensor_upgrades."""

import pytest

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import ConfigError, UnknownQuantTypeError
from voodoo_quant.selection.menus import MenuConfig, apply_upgrades, build_menu, parse_upgrades

RECIPE_DEFAULT = ("Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")
RECIPE_ATTN = ("Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS")
RECIPE_OTHER = ("IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S")


def test_576_wide_menus_follow_llama_cpp_fallback():
    # src/llama-quant.cpp tensor_type_fallback: IQ* -> IQ4_NL, Q5_K -> Q5_1; Q8_0 fits 576 = 18 x 32.
    assert build_menu(RECIPE_DEFAULT, 576, True).types == ("IQ4_NL", "Q5_1", "Q8_0")
    assert build_menu(RECIPE_ATTN, 576, True).types == ("IQ4_NL", "Q5_1")
    assert build_menu(RECIPE_OTHER, 576, True).types == ("IQ4_NL",)
    m = build_menu(RECIPE_DEFAULT, 576, True)
    assert m.fallbacks == {"Q5_K": "Q5_1", "IQ3_S": "IQ4_NL", "IQ2_S": "IQ4_NL", "IQ2_XXS": "IQ4_NL", "IQ1_S": "IQ4_NL"}


def test_256_multiple_keeps_native_types_ordered_by_bits():
    m = build_menu(RECIPE_DEFAULT, 1536, True)
    assert m.types == ("IQ1_S", "IQ2_XXS", "IQ2_S", "IQ3_S", "Q5_K", "Q8_0")
    bpw = [qt.get(t).bpw for t in m.types]
    assert bpw == sorted(bpw)


def test_rows_not_multiple_of_32_fall_to_f16():
    assert build_menu(("Q4_K", "Q8_0", "IQ2_S"), 100, True).types == ("F16",)


def test_types_needing_imatrix_dropped_without_one():
    m = build_menu(RECIPE_DEFAULT, 512, has_imatrix=False)
    assert m.types == ("IQ3_S", "Q5_K", "Q8_0")
    assert set(m.dropped_no_imatrix) == {"IQ2_S", "IQ2_XXS", "IQ1_S"}


def test_menu_config_roles_and_validation():
    mc = MenuConfig(RECIPE_DEFAULT, RECIPE_ATTN, RECIPE_OTHER)
    assert mc.types_for("attention") == RECIPE_ATTN
    assert mc.types_for("other") == RECIPE_OTHER
    assert MenuConfig(("q4_k", "Q8_0,Q6_K")).candidate_types == ("Q4_K", "Q8_0", "Q6_K")
    with pytest.raises(UnknownQuantTypeError, match="Q9_9"):
        MenuConfig(("Q9_9",))
    with pytest.raises(ConfigError, match="F32"):
        MenuConfig(("F32",))


RECIPE_UPGRADES = '[{"pattern":"mlp\\\\.(gate|up|down)_proj$","levels":1}, {"pattern":"linear_attn|self_attn","levels":-1}]'


def test_upgrades_move_rungs_and_clamp():
    ups = parse_upgrades(RECIPE_UPGRADES)
    menu = ("IQ2_XXS", "IQ2_S", "IQ3_S", "Q5_K")
    assert apply_upgrades("model.layers.3.mlp.down_proj.weight", menu, 1, ups) == 2
    assert apply_upgrades("model.layers.3.mlp.down_proj.weight", menu, 3, ups) == 3  # clamped at the top
    assert apply_upgrades("model.layers.3.self_attn.q_proj.weight", menu, 1, ups) == 0
    assert apply_upgrades("model.layers.3.self_attn.q_proj.weight", menu, 0, ups) == 0  # clamped at the bottom
    assert apply_upgrades("model.embed_tokens.weight", menu, 2, ups) == 2
    big = parse_upgrades('[{"pattern": "embed", "levels": 5}]')
    assert apply_upgrades("model.embed_tokens.weight", menu, 0, big) == 3


@pytest.mark.parametrize("bad, msg", [
    ("not json", "not valid JSON"),
    ('{"pattern": "x", "levels": 1}', "JSON list"),
    ('[{"pattern": "(", "levels": 1}]', "invalid regex"),
    ('[{"pattern": "x", "levels": "1"}]', "integer"),
    ('[{"pattern": "x"}]', "exactly the keys"),
])
def test_upgrades_bad_input_is_a_config_error(bad, msg):
    with pytest.raises(ConfigError, match=msg):
        parse_upgrades(bad)


def test_menu_drops_are_one_line_per_type(caplog):
    # Without an imatrix every tensor loses the same types: one warning per type with the count,
    # not one per tensor.
    import logging

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from voodoo_quant.arch import adapter_for
    from voodoo_quant.student.build import plan_model

    torch.manual_seed(0)
    model = LlamaForCausalLM(LlamaConfig(vocab_size=128, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                                         num_attention_heads=4, num_key_value_heads=2, head_dim=64)).eval()
    with caplog.at_level(logging.WARNING, logger="voodoo_quant"):
        plans = plan_model(model, adapter_for(model.config), MenuConfig(("Q8_0", "IQ3_S", "IQ2_XXS", "IQ1_S")))
    assert len(plans) == 16  # 2 layers × 7 Linears, the embedding, the LM head
    assert all(p.menu.types == ("IQ3_S", "Q8_0") for p in plans)
    drops = [r.getMessage() for r in caplog.records if "dropped" in r.getMessage()]
    assert len(drops) == 2, drops
    for t, line in zip(("IQ2_XXS", "IQ1_S"), sorted(drops, key=lambda m: "IQ1_S" in m)):
        assert line.startswith(f"dropped {t} from the menus of 16 tensor(s) that no imatrix covers"), line


def test_a_filled_menu_takes_every_size_its_row_admits():
    """The default menu on 576-wide rows serves four rungs, two of them 4.5 bpw (Q2_K → Q4_0, the
    IQ types → IQ4_NL); filled, the fallback Q4_0 gives way to IQ4_NL, the better of that size,
    and the row's other types in the requested size range join them, one per size."""
    from voodoo_quant.selection.menus import DEFAULT_CANDIDATES

    plain = build_menu(DEFAULT_CANDIDATES, 576, has_imatrix=True)
    filled = build_menu(DEFAULT_CANDIDATES, 576, has_imatrix=True, fill=True)
    assert plain.types == ("Q4_0", "IQ4_NL", "Q5_1", "Q8_0")
    assert filled.types == ("MXFP4", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    assert filled.fallbacks == plain.fallbacks  # what was asked for and what served it, unchanged
    bpw = [qt.get(t).bpw for t in filled.types]
    assert bpw == sorted(set(bpw))  # one type per size, cheapest first
    # only inside the range asked for: Q5_K (5.5 bpw) to Q8_0 gains Q5_0, not MXFP4 or Q4_1
    assert build_menu(("Q5_K", "Q8_0"), 576, False, fill=True).types == ("Q5_0", "Q5_1", "Q8_0")
    assert build_menu(("Q4_K", "Q8_0"), 576, False, fill=True).types == ("IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    # rows every type fits are left as asked, filled or not
    for n in (1536, 2048):
        assert build_menu(DEFAULT_CANDIDATES, n, True, fill=True).types == build_menu(DEFAULT_CANDIDATES, n, True).types
    # a type the row would take but that needs an imatrix is not added without one
    m = build_menu(("IQ2_XXS", "Q8_0"), 64 * 3, has_imatrix=False, fill=True)
    assert all(not qt.get(t).needs_imatrix for t in m.types)
    # a fallback gives way to a better type of its size; a type the menu names itself does not
    assert build_menu(("Q2_K", "IQ3_S", "Q8_0"), 576, True).types == ("Q4_0", "IQ4_NL", "Q8_0")
    assert build_menu(("Q2_K", "IQ3_S", "Q8_0"), 576, True, fill=True).types == (
        "MXFP4", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    assert build_menu(("Q4_0", "IQ3_S", "Q8_0"), 576, True, fill=True).types == (
        "MXFP4", "Q4_0", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0")
    assert build_menu(("Q4_0", "IQ4_NL", "Q8_0"), 576, True, fill=True).types == ("Q4_0", "IQ4_NL", "Q8_0")


def test_the_default_menu_on_576_wide_rows_is_the_reference_recipes_under_fill():
    """SmolLM2's 576-wide rows are no multiple of 256, so every rung the default menu gained
    (Q6_K, IQ4_XS, IQ3_XXS, Q2_K) falls back (src/llama-quant.cpp tensor_type_fallback): Q6_K to
    Q8_0, IQ4_XS and IQ3_XXS to IQ4_NL, which the menu already served, and Q2_K to Q4_0, which
    ties IQ4_NL at 4.5 bpw and loses the tie in a filled menu. So filled, as the default menu is,
    such a tensor's menu is exactly what the reference recipe's six-type default gave it, with an
    imatrix and without one (an embedding's); only the fallbacks recorded name more types."""
    from voodoo_quant.selection.menus import DEFAULT_CANDIDATES

    assert set(DEFAULT_CANDIDATES) - set(RECIPE_DEFAULT) == {"Q6_K", "IQ4_XS", "IQ3_XXS", "Q2_K"}
    for has_im in (True, False):
        new = build_menu(DEFAULT_CANDIDATES, 576, has_im, fill=True)
        old = build_menu(RECIPE_DEFAULT, 576, has_im, fill=True)
        assert new.types == old.types == ("MXFP4", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0"), has_im
        assert {k: v for k, v in new.fallbacks.items() if k in RECIPE_DEFAULT} == old.fallbacks
        assert {k: new.fallbacks[k] for k in ("Q6_K", "IQ4_XS", "IQ3_XXS", "Q2_K")} == {
            "Q6_K": "Q8_0", "IQ4_XS": "IQ4_NL", "IQ3_XXS": "IQ4_NL", "Q2_K": "Q4_0"}
        assert new.dropped_no_imatrix == old.dropped_no_imatrix == ()  # IQ4_NL needs none


def test_the_default_menu_on_1536_wide_rows_holds_every_rung():
    """A row that is a multiple of 256 takes all ten default types, cheapest first; a tensor no
    imatrix covers (the embedding, the output head) loses the four llama-quantize refuses without
    one (IQ3_XXS, IQ2_S, IQ2_XXS, IQ1_S) and keeps six, Q2_K its cheapest."""
    from voodoo_quant.selection.menus import DEFAULT_CANDIDATES

    m = build_menu(DEFAULT_CANDIDATES, 1536, has_imatrix=True)
    assert m.types == ("IQ1_S", "IQ2_XXS", "IQ2_S", "Q2_K", "IQ3_XXS", "IQ3_S", "IQ4_XS", "Q5_K", "Q6_K", "Q8_0")
    assert m.types == tuple(reversed(DEFAULT_CANDIDATES))  # the tuple is written best first
    assert not m.fallbacks and not m.dropped_no_imatrix
    assert build_menu(DEFAULT_CANDIDATES, 1536, True, fill=True).types == m.types
    bare = build_menu(DEFAULT_CANDIDATES, 1536, has_imatrix=False)
    assert bare.types == ("Q2_K", "IQ3_S", "IQ4_XS", "Q5_K", "Q6_K", "Q8_0")
    assert set(bare.dropped_no_imatrix) == {"IQ3_XXS", "IQ2_S", "IQ2_XXS", "IQ1_S"}
    assert {t for t in DEFAULT_CANDIDATES if qt.get(t).needs_imatrix} == set(bare.dropped_no_imatrix)


def test_fill_is_the_default_only_for_the_default_menu():
    from voodoo_quant.selection.menus import DEFAULT_CANDIDATES, default_fill
    from voodoo_quant.training.config import TrainConfig

    assert default_fill(None, None, None) and default_fill(list(DEFAULT_CANDIDATES), None, None)
    assert not default_fill(["Q8_0", "Q4_0"], None, None)
    # the reference recipe's six types, the default once, are a menu the user names: not filled
    assert not default_fill(list(RECIPE_DEFAULT), None, None)
    assert not default_fill(list(RECIPE_DEFAULT), RECIPE_ATTN, RECIPE_OTHER)
    assert not default_fill(None, ["Q8_0"], None)
    base = dict(model="m", compression_ratio=0.5)
    assert TrainConfig(**base).fill_menus is True and TrainConfig(**base).menus.fill
    assert TrainConfig(**base, candidate_types=("Q8_0", "Q4_0")).fill_menus is False
    assert TrainConfig(**base, candidate_types=RECIPE_DEFAULT).fill_menus is False
    assert TrainConfig(**base, candidate_types=DEFAULT_CANDIDATES).fill_menus is True
    assert TrainConfig(**base, candidate_types=("Q8_0", "Q4_0"), fill_menus=True).menus.fill
    assert TrainConfig(**base, fill_menus=False).menus.fill is False
    # resolved once: the journal's key and a config read back from it agree
    cfg = TrainConfig(**base)
    assert TrainConfig.from_dict(cfg.to_dict()).result_hash() == cfg.result_hash()
    assert TrainConfig(**base, fill_menus=False).result_hash() != cfg.result_hash()
