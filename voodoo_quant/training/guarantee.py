"""Never worse than the free alternatives: measure them and write the best (or search from it).

Before anything is written, every assignment a user could have had for free at the same budget
is measured on the held-aside calibration split (``objective.HeldAside``) beside the gates' own:

- ``uniform <T>``: every tensor the same type T (through llama.cpp's fallback for its rows), the
  largest uniform files that fit;
- ``stock <FTYPE>``: the types stock ``llama-quantize`` writes per tensor for an ftype
  (``voodoo_quant/gguf/recipes.py``, its rules reproduced and tested against the tool), the largest
  recipes that fit;
- ``knapsack``: the one-shot sensitivity knapsack (``knapsack.greedy_layout``) up to the upper
  bound, and ``knapsack+polish``: the assignment ``--method sensitivity`` writes (the greedy layout
  at the training target, baked and polished: ``methods.sensitivity_choice``). Both minimize the
  same additive table, but they differ in tens of tensors, and on 64 validation sequences at
  Voodoo60 the second had 6 % less KL (docs/lab/2026-12-03-two-knapsacks.md), so both are measured;
- ``gates`` (and ``gates+polish``): the bake of the trained gates.

"Fits" means at most the budget's upper bound, ``target × (1 + tolerance)``. The best measured
one is written, or, under ``--search_evals N`` (off by default), is where the final search
(``search.local_search``) starts; either way the written assignment is at least as good as every
reference on that split, and the report says which won and by how much.
Tensors pinned by ``--tensor_upgrades`` keep the bake's type in every candidate.

The references' off-menu types (a recipe's Q6_K where the menu has none) need their candidates
quantized from the float weights, which the student no longer holds once the gates replace them:
``plan_references`` runs in the trainer's setup, before the student is built, and its off-menu
bytes go through the candidate cache like every other candidate.

**Which bytes a reference is measured with.** A tensor holds one set of bytes per type (its rungs,
``rungs.py``), so a reference's tensor in type T is served:

- T on the tensor's menu: the run's own candidate, error-compensated under
  ``--error_compensation gptq`` (the bytes the gates choose among);
- T off the tensor's menu: plain, ``ggml_quantize_chunk`` of the float weights with the run's
  imatrix vector and no compensation (``setup.extra_candidate_blobs``): exactly the tensor stock
  ``llama-quantize`` writes in T from the same weights and imatrix.

So ``stock <FTYPE>`` measures stock's per-tensor types with stock's own bytes wherever the menus
lack the type, and the run's compensated candidate wherever a menu has it; without compensation
(or where no type of the recipe is on a menu) it is stock's file, tensor for tensor. The same holds
for ``uniform <T>``; the knapsacks are menu types only. A reference stands for what a user gets
for free from stock ``llama-quantize``: its off-menu types cost a plain candidate each (IQ1_M's
compensation walk is ~10× one, ``compensate.py``), not a compensated one nobody would otherwise
make. The search's off-menu rungs are these plain bytes too. The assignment records per tensor
whether its bytes are compensated (``TensorChoice.compensated``: False for an off-menu type), and
export writes those bytes (checked against the recorded sha256), not compensated ones.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Mapping, Sequence

from ..core import qtypes as qt
from ..gguf import recipe_inputs, recipes
from ..selection.menus import is_pinned

log = logging.getLogger(__name__)

# Uniform candidates: every type a GGUF is commonly made of (the union of the menus is added).
UNIFORM_TYPES = ("Q8_0", "Q6_K", "Q5_K", "Q5_1", "Q5_0", "Q4_K", "Q4_1", "Q4_0", "IQ4_NL", "IQ4_XS", "Q3_K", "IQ3_S",
                 "IQ3_XXS", "Q2_K", "IQ2_S", "IQ2_XS", "IQ2_XXS", "IQ1_M", "IQ1_S")
MEASURE_UNIFORM = 2  # the largest uniform files that fit are measured ...
MEASURE_STOCK = 3  # ... and the largest stock recipes


@dataclass
class Candidate:
    name: str
    types: dict[str, str]  # tensor -> ggml type
    total_bytes: int
    kl: float | None = None
    kl_stderr: float | None = None

    def to_dict(self) -> dict:
        return {"name": self.name, "bytes": self.total_bytes, "kl": self.kl, "kl_stderr": self.kl_stderr}


@dataclass
class References:
    candidates: list[Candidate] = field(default_factory=list)
    extra: dict[str, set[str]] = field(default_factory=dict)  # tensor -> off-menu types the candidates use


def rung_bytes(plan, qtype: str) -> int:
    """The GGUF bytes of tensor `plan` at `qtype`."""
    return qt.get(qtype).row_bytes(plan.n_per_row) * plan.rows


def stock_provider(plans: Sequence, config, has_imatrix: bool) -> Callable[[str], Mapping[str, str] | None]:
    """ftype -> {tensor: type} stock llama-quantize writes for this model (``recipes.py``), or
    None where the tool would refuse the ftype (it needs an imatrix the run lacks)."""
    def stock(ftype: str) -> Mapping[str, str] | None:
        try:
            return recipe_inputs.stock_types(plans, config, ftype, has_imatrix=has_imatrix)
        except recipes.RecipeError:
            return None
    return stock


def uniform_types(plan, qtype: str, has_imatrix: bool) -> str | None:
    """The type tensor `plan` gets in a uniform `qtype` file (llama.cpp's fallback), or None
    when it would need an imatrix that does not cover the tensor."""
    q = qt.resolve_for_row(qtype, plan.n_per_row)
    if q.needs_imatrix and not has_imatrix:
        return None
    return q.name


def plan_references(plans: Sequence, hi: float, *, covered: set[str], knapsack: Mapping[str, Mapping[str, int]] | None = None,
                    stock: Callable[[str], Mapping[str, str] | None] | None = None,
                    stock_ftypes: Sequence[str] = (), menu_types: Sequence[str] = ()) -> References:
    """The free references that fit under `hi` bytes: the largest uniform files and stock recipes
    (at most MEASURE_UNIFORM / MEASURE_STOCK of each) and the knapsack layouts (name -> tensor ->
    menu index; one candidate per distinct assignment, the first name kept)."""
    refs = References()
    uniform = []
    for t in dict.fromkeys([*UNIFORM_TYPES, *menu_types]):
        types = {}
        for p in plans:
            u = uniform_types(p, t, p.gguf_name in covered)
            if u is None:
                break
            types[p.name] = u
        else:
            total = sum(rung_bytes(p, types[p.name]) for p in plans)
            if total <= hi:
                uniform.append(Candidate(f"uniform {qt.get(t).name}", types, total))
    uniform = _largest_distinct(uniform, MEASURE_UNIFORM)
    stocks = []
    for f in stock_ftypes if stock is not None else ():
        types = stock(f)
        if not types or set(types) != {p.name for p in plans}:
            continue
        total = sum(rung_bytes(p, types[p.name]) for p in plans)
        if total <= hi:
            stocks.append(Candidate(f"stock {f}", dict(types), total))
    stocks = _largest_distinct(stocks, MEASURE_STOCK)
    refs.candidates = uniform + stocks
    seen = []
    for name, layout in (knapsack or {}).items():
        types = {p.name: p.menu.types[layout[p.name]] for p in plans}
        if types not in seen:  # one measurement per distinct assignment
            seen.append(types)
            refs.candidates.append(Candidate(name, types, sum(p.sizes[layout[p.name]] for p in plans)))
    by = {p.name: p for p in plans}
    for c in refs.candidates:
        for n, t in c.types.items():
            if t not in by[n].menu.types:
                refs.extra.setdefault(n, set()).add(t)
    return refs


def _largest_distinct(cands: list[Candidate], k: int) -> list[Candidate]:
    """The `k` largest candidates, one per distinct assignment (fallbacks make some identical)."""
    out, seen = [], set()
    for c in sorted(cands, key=lambda c: (-c.total_bytes, c.name)):
        sig = tuple(sorted(c.types.items()))
        if sig in seen:
            continue
        seen.add(sig)
        out.append(c)
        if len(out) == k:
            break
    return out


def pin(c: Candidate, baked: Mapping[str, str], plans: Sequence, upgrades) -> Candidate:
    """`c` with every pinned tensor on the bake's type (the user's --tensor_upgrades hold)."""
    if not upgrades:
        return c
    by = {p.name: p for p in plans}
    types = {n: (baked[n] if is_pinned(n, upgrades) else t) for n, t in c.types.items()}
    return Candidate(c.name, types, sum(rung_bytes(by[n], t) for n, t in types.items()))
