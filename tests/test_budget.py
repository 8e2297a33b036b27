"""The budget's impossible-target error says whether types off the menus would reach the size."""

from types import SimpleNamespace

import pytest

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import ConfigError
from voodoo_quant.selection import menus
from voodoo_quant.selection.budget import cheapest_for_row, make_budget

# SmolLM2-135M's selectable tensors (rows, n_per_row): the tied embedding, then 30 layers of
# q, k, v, o, gate, up (576-wide rows) and down (1536-wide rows).
SMOLLM2 = [(49152, 576)] + [(576, 576), (192, 576), (192, 576), (576, 576), (1536, 576), (1536, 576), (576, 1536)] * 30


def _plans(types):
    out = []
    for rows, n in SMOLLM2:
        menu = menus.build_menu(types, n, has_imatrix=True).types
        out.append(SimpleNamespace(shape=(rows, n), rows=rows, n_per_row=n,
                                   sizes=[qt.get(t).row_bytes(n) * rows for t in menu]))
    return out


def test_cheapest_type_per_row_length():
    assert cheapest_for_row(576).name == "MXFP4"  # 576 = 18 × 32: 32-block types only
    assert cheapest_for_row(1536).name == "IQ1_S"
    assert cheapest_for_row(100).is_float  # no quantized type takes a 100-wide row


def test_a_size_below_the_menus_names_the_types_that_would_reach_it():
    plans = _plans(["Q8_0", "Q5_K", "IQ4_NL", "IQ2_S"])  # 576-wide rows: IQ4_NL at the least
    with pytest.raises(ConfigError) as e:
        make_budget(plans, compression_ratio=0.45, target_bits=None)
    msg = str(e.value)
    assert "0.484–1.000 of Q8_0" in msg and "floor is 0.438 of Q8_0" in msg
    assert "576-wide rows MXFP4 (4.25 bpw)" in msg and "1536-wide rows IQ1_S (1.5625 bpw, needs an imatrix)" in msg
    # with those types on the menus, the same size is made
    assert make_budget(_plans(["Q8_0", "MXFP4", "IQ1_S"]), compression_ratio=0.45, target_bits=None).target_bytes > 0


def test_a_size_below_every_type_says_so():
    with pytest.raises(ConfigError, match="no llama.cpp type is cheaper"):
        make_budget(_plans(["Q8_0", "MXFP4", "IQ1_S"]), compression_ratio=0.40, target_bits=None)
    with pytest.raises(ConfigError) as e:  # above the richest rung: no floor talk
        make_budget(_plans(["Q8_0", "MXFP4"]), compression_ratio=1.5, target_bits=None)
    assert "floor" not in str(e.value) and "cheaper" not in str(e.value)
