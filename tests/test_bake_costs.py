"""The bake's repair and fill costs and the pins of --tensor_upgrades."""

from types import SimpleNamespace

import pytest
import torch

from voodoo_quant.core.errors import ConfigError
from voodoo_quant.selection.budget import Budget
from voodoo_quant.selection.menus import is_pinned, parse_upgrades
from voodoo_quant.training.bake import bake


def _plans(spec):
    """spec: name -> sizes (cheapest first)."""
    return [SimpleNamespace(name=n, sizes=tuple(s), menu=SimpleNamespace(types=tuple(f"q{i}" for i in range(len(s)))))
            for n, s in spec.items()]


def _budget(target, tol=0.02):
    return Budget(q8_bytes=target * 2, min_bytes=0, max_bytes=target * 4, n_weights=1, target_bytes=target,
                  train_target_bytes=target, tolerance=tol)


def test_repair_ranks_by_logit_gaps_not_bytes():
    """Saturated probabilities would make every cost ≈ 1/bytes (the big tensor first); the logits
    still say the big tensor cares far more than the small one."""
    plans = _plans({"big": (1000, 2000), "small": (100, 600)})
    logits = {"big": torch.tensor([0.0, 5.0]), "small": torch.tensor([0.0, 0.1])}
    res = bake(plans, logits, _budget(2150, tol=0.0))
    assert res.argmax == {"big": 1, "small": 1}
    assert res.choice == {"big": 1, "small": 0} and res.repaired == 1


def test_fill_ranks_by_logit_gaps_not_bytes():
    plans = _plans({"big": (1000, 2000), "small": (100, 600)})
    logits = {"big": torch.tensor([5.0, 0.0]), "small": torch.tensor([0.2, 0.0])}
    res = bake(plans, logits, _budget(2000, tol=0.1))
    assert res.argmax == {"big": 0, "small": 0}
    assert res.choice == {"big": 0, "small": 1} and res.filled == 1


def test_upgrades_stay_pinned_through_repair_and_fill():
    plans = _plans({"model.layers.0.mlp.up_proj.weight": (100, 200, 400),
                    "model.layers.0.self_attn.q_proj.weight": (100, 200, 400),
                    "model.layers.1.self_attn.q_proj.weight": (100, 200, 400)})
    ups = parse_upgrades('[{"pattern": "mlp\\\\.(gate|up|down)_proj$", "levels": 1}]')
    mlp = "model.layers.0.mlp.up_proj.weight"
    assert is_pinned(mlp, ups) and not is_pinned("model.layers.0.self_attn.q_proj.weight", ups)
    # every argmax on the middle rung; the upgrade lifts mlp to 400; over budget -> repair
    logits = {p.name: torch.tensor([0.0, 1.0, 0.5]) for p in plans}
    res = bake(plans, logits, _budget(700, tol=0.0), ups)
    assert res.choice[mlp] == 2 and res.upgraded == 1 and res.pinned == (mlp,)
    assert res.total_bytes <= 700
    # under budget -> fill never touches the pinned tensor either (it would be the cheapest up-move)
    down = parse_upgrades('[{"pattern": "mlp\\\\.(gate|up|down)_proj$", "levels": -1}]')
    logits = {p.name: torch.tensor([0.0, 1.0, 0.9]) for p in plans}
    logits[mlp] = torch.tensor([0.0, 1.0, 0.99])
    res = bake(plans, logits, _budget(1000, tol=0.05), down)
    assert res.choice[mlp] == 0 and res.filled >= 1
    with pytest.raises(ConfigError, match="pinned"):
        bake(plans, {p.name: torch.tensor([0.0, 0.0, 1.0]) for p in plans}, _budget(300, tol=0.0),
             parse_upgrades('[{"pattern": "q_proj$", "levels": 0}]'))


def test_method_sensitivity_repairs_by_its_table_from_its_layout():
    """``--method sensitivity`` bakes its knapsack layout with −s as the scores: after an upgrade
    pushes the size over budget, repair gives up the rung the table values least per byte (the
    small tensor here), where the layout's warm-start logits (one rung preferred, the others
    equal) would rank every move by bytes alone and take the big tensor down first."""
    from voodoo_quant.training.sensitivity import warm_logits

    plans = _plans({"model.layers.0.mlp.up_proj.weight": (100, 200, 400),
                    "model.layers.0.self_attn.q_proj.weight": (1000, 2000, 4000),
                    "model.layers.0.self_attn.k_proj.weight": (500, 1000, 2000)})
    mlp, big, small = (p.name for p in plans)
    table = {mlp: [0.5, 0.2, 0.0], big: [9.0, 4.0, 0.0], small: [0.30, 0.01, 0.0]}
    layout = {mlp: 1, big: 2, small: 2}
    ups = parse_upgrades('[{"pattern": "mlp\\\\.(gate|up|down)_proj$", "levels": 1}]')
    budget = _budget(6200, tol=0.0)  # layout 6200 bytes, the upgrade adds 200
    res = bake(plans, {n: [-x for x in v] for n, v in table.items()}, budget, ups, start=layout)
    assert res.argmax == layout and res.choice == {mlp: 2, big: 2, small: 1} and res.repaired == 1
    warm = bake(plans, warm_logits(plans, layout, 1.0, 0.9), budget, ups)
    assert warm.choice[big] == 1  # what the previous scores did: the biggest saving, whatever it cost
