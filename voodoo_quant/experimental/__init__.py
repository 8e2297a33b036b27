"""Experiments: settings that were measured no better than the default, kept out of the main path.

Each registers here with the settings that switch it on and the docs/lab entry that measured it;
`voodoo train --help` lists their flags only under ``VOODOO_HELP_EXPERIMENTAL=1`` (they work
either way), and a run that switches one on says so in its log (:func:`active`). The code of each:

- ``routing.py``: per-token routing (``--ptqr``) and straight-through Gumbel hardening
  (``--st_gumbel_fraction``, ``--st_gumbel_tau``): a hard forward during training;
- ``relaxation.py``: the relaxation gap (``--relaxation_gap``), the KL the soft mixture hides;
- ``search.py``: the measured-KL local search after the guarantee (``--search_evals``,
  ``--search_margin``, ``--search_confirm``);
- ``measured.py``: the measured sensitivity table (``--sensitivity_kind measured``); the output-error
  table (``--sensitivity_kind output``) is ``training/sensitivity.py``'s own pass.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

LAB = "docs/lab/"


@dataclass(frozen=True)
class Experiment:
    name: str
    settings: tuple[str, ...]  # TrainConfig fields that switch it on (away from their defaults)
    lab: str  # the docs/lab entry that measured it
    what: str

    def active(self, cfg) -> bool:
        defaults = {f.name: f.default for f in dataclasses.fields(cfg)}
        return any(getattr(cfg, s) != defaults[s] for s in self.settings)


REGISTRY: dict[str, Experiment] = {}


def register(exp: Experiment) -> Experiment:
    if exp.name in REGISTRY:
        raise ValueError(f"experiment {exp.name!r} registered twice")
    REGISTRY[exp.name] = exp
    return exp


register(Experiment("routing", ("ptqr", "st_gumbel_fraction", "st_gumbel_tau"),
                    LAB + "2026-11-30-first-benchmark-and-training-modes.md", "a hard forward while training"))
register(Experiment("relaxation_gap", ("relaxation_gap",),
                    LAB + "2026-12-01-fisher-sensitivity-guarantee-search.md", "the mixture's hidden KL in the loss"))
register(Experiment("search", ("search_evals", "search_margin", "search_confirm"),
                    LAB + "2026-12-03-search-transfer-and-confirmation.md", "a measured-KL search after the guarantee"))
register(Experiment("sensitivity_kind", ("sensitivity_kind",),
                    LAB + "2026-12-01-fisher-sensitivity-guarantee-search.md", "another sensitivity table than Fisher's"))


def active(cfg) -> list[Experiment]:
    """The experiments `cfg` switches on."""
    return [e for e in REGISTRY.values() if e.active(cfg)]
