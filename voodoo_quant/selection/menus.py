"""Per-tensor menus: which ggml types a tensor may take, cheapest first.

A tensor's role (attention family or not, decided by the arch adapter's ``attention_segments``)
picks ``attention_candidates`` / ``non_attention_candidates``, else ``candidate_types``. Each type
is mapped through llama.cpp's fallback for the tensor's GGUF row length
(``src/llama-quant.cpp`` ``tensor_type_fallback``), duplicates collapse, and types that need an
imatrix are dropped when none covers the tensor. The result is ordered by bits per weight: these
are the rungs that ``--tensor_upgrades`` moves along.

A menu whose types fall back on a tensor's row length loses rungs: the default menu on a row of
576 weights (not a multiple of 256) serves only Q4_0 (Q2_K's fallback), IQ4_NL (the IQ types'),
Q5_1 and Q8_0. Where menus are *filled* (the default when the user names no menu), a fallback
that ties a better served type in size gives way to it (Q4_0 to IQ4_NL), and such a tensor also
takes every other type its row length admits within the size range the menu asked for (MXFP4,
Q4_1, Q5_0 there), one per size: the rungs the stock tool itself would use on that row.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from typing import Iterable, Sequence

from ..core import qtypes as qt
from ..core.errors import ConfigError

# The default menu: every K and IQ rung between Q8_0 and the Q2_K class that measured useful, and
# the reference recipe's grid types below it. On Qwen2.5-Coder-1.5B the knapsack put each of Q6_K,
# IQ4_XS, IQ3_XXS and Q2_K to use, and adding them to the reference recipe's six (Q8_0 Q5_K IQ3_S
# IQ2_S IQ2_XXS IQ1_S, which the recipe names itself) lowered the file's KLD at the same size
# (WHITEPAPER §4, "The default menu at 1.5B"). Written best first, as the flag's help shows it;
# build_menu sorts each tensor's menu cheapest first. The embedding and the output head have no
# imatrix: IQ3_XXS, IQ2_S, IQ2_XXS and IQ1_S leave their menus, and Q2_K, a K-quant, is their
# cheapest rung.
DEFAULT_CANDIDATES: tuple[str, ...] = ("Q8_0", "Q6_K", "Q5_K", "IQ4_XS", "IQ3_S", "IQ3_XXS", "Q2_K", "IQ2_S",
                                       "IQ2_XXS", "IQ1_S")
_TABLE_ORDER = {name: i for i, name in enumerate(qt.QTYPES)}


def _norm_types(types: Iterable[str] | None, flag: str) -> tuple[str, ...] | None:
    if types is None:
        return None
    if isinstance(types, str):
        types = [types]
    out = []
    for t in types:
        for part in str(t).replace(",", " ").split():
            q = qt.get(part)
            if q.name == "F32":
                raise ConfigError(f"{flag}: F32 is not a quantization candidate")
            if q.name not in out:
                out.append(q.name)
    if not out:
        raise ConfigError(f"{flag}: empty list of candidate types")
    return tuple(out)


def default_fill(candidate_types: Sequence[str] | None, attention_candidates: Sequence[str] | None,
                 non_attention_candidates: Sequence[str] | None) -> bool:
    """Whether menus are filled when the user does not say: yes for the default menu (no menu
    named, or one equal to :data:`DEFAULT_CANDIDATES`), no for a menu the user chose (the
    reference recipe's six types included: they were the default once, and are a named menu now)."""
    named = _norm_types(candidate_types, "--candidate_types")
    return (named is None or named == DEFAULT_CANDIDATES) and not attention_candidates and not non_attention_candidates


@dataclass(frozen=True)
class MenuConfig:
    candidate_types: tuple[str, ...] = DEFAULT_CANDIDATES
    attention_candidates: tuple[str, ...] | None = None
    non_attention_candidates: tuple[str, ...] | None = None
    fill: bool = False  # a menu that falls back on a tensor's row also takes the row's other types

    def __post_init__(self) -> None:
        object.__setattr__(self, "candidate_types", _norm_types(self.candidate_types, "--candidate_types"))
        object.__setattr__(self, "attention_candidates", _norm_types(self.attention_candidates, "--attention_candidates"))
        object.__setattr__(
            self, "non_attention_candidates", _norm_types(self.non_attention_candidates, "--non_attention_candidates")
        )

    def types_for(self, role: str) -> tuple[str, ...]:
        if role == "attention" and self.attention_candidates:
            return self.attention_candidates
        if role == "other" and self.non_attention_candidates:
            return self.non_attention_candidates
        return self.candidate_types


def rung_key(q: qt.QType) -> tuple[float, int]:
    """Cheapest first; at equal bits, the type the table lists later (lower quality) first."""
    return (q.bpw, -_TABLE_ORDER[q.name])


@dataclass(frozen=True)
class Menu:
    types: tuple[str, ...]  # cheapest first, after fallback and de-duplication
    requested: tuple[str, ...]  # what the flags asked for
    fallbacks: dict[str, str] = field(default_factory=dict)  # requested -> served, where they differ
    dropped_no_imatrix: tuple[str, ...] = ()


# Types a filled menu may add: the quantized types llama.cpp serves for ordinary weights (not the
# floats, not the ternary TQ types, which only suit ternary-trained models).
FILL_TYPES: tuple[str, ...] = tuple(n for n, q in qt.QTYPES.items() if not q.is_float and not n.startswith("TQ"))


def build_menu(types: Sequence[str], n_per_row: int, has_imatrix: bool, fill: bool = False) -> Menu:
    """The menu of a tensor whose rows hold `n_per_row` weights: `types` through llama.cpp's
    fallbacks, de-duplicated, cheapest first; with `fill`, where a type fell back, a type served
    only as a fallback is left out where a better one of its size is served, and every type of
    :data:`FILL_TYPES` that the row takes whose size lies within the requested types' range and
    that no served type already has is added (at equal size the better one, the table's first)."""
    served: dict[str, qt.QType] = {}
    fallbacks: dict[str, str] = {}
    dropped: list[str] = []
    for name in types:
        q = qt.resolve_for_row(name, n_per_row)
        if q.name != qt.get(name).name:
            fallbacks[qt.get(name).name] = q.name
        if q.needs_imatrix and not has_imatrix:
            dropped.append(q.name)
            continue
        served.setdefault(q.name, q)
    if fill and fallbacks:
        # Two requested types may fall back to types of one size (Q2_K → Q4_0 and IQ3_S → IQ4_NL,
        # both 4.5 bpw, on a row of 576): a type served only as a fallback gives way to a better
        # one of its size (the table's first), as the row's other types are added below. A type
        # the menu names itself stays.
        named = {qt.get(t).name for t in types}
        served = {n: q for n, q in served.items()
                  if n in named or not any(p.bpw == q.bpw and _TABLE_ORDER[p.name] < _TABLE_ORDER[n]
                                           for p in served.values())}
        asked = [qt.get(t).bpw for t in types]
        lo, hi = min(asked), max(asked)
        sizes = {q.bpw for q in served.values()}
        for name in FILL_TYPES:  # quality order: at an equal size the better type comes first
            q = qt.QTYPES[name]
            if q.fits(n_per_row) and lo <= q.bpw <= hi and q.bpw not in sizes and (has_imatrix or not q.needs_imatrix):
                served[name] = q
                sizes.add(q.bpw)
    ordered = tuple(q.name for q in sorted(served.values(), key=rung_key))
    return Menu(ordered, tuple(qt.get(t).name for t in types), fallbacks, tuple(dict.fromkeys(dropped)))


# -- --tensor_upgrades ------------------------------------------------------------------------


@dataclass(frozen=True)
class Upgrade:
    pattern: str
    levels: int

    def __post_init__(self) -> None:
        try:
            re.compile(self.pattern)
        except re.error as e:
            raise ConfigError(f"--tensor_upgrades: invalid regex {self.pattern!r}: {e}") from None
        if not isinstance(self.levels, int) or isinstance(self.levels, bool):
            raise ConfigError(f"--tensor_upgrades: levels must be an integer, got {self.levels!r}")

    def matches(self, name: str) -> bool:
        return re.search(self.pattern, name) is not None


def parse_upgrades(text: str | None) -> tuple[Upgrade, ...]:
    """Parse ``--tensor_upgrades`` JSON: a list of ``{"pattern": regex, "levels": ±n}``."""
    if text is None or not str(text).strip():
        return ()
    try:
        data = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"--tensor_upgrades is not valid JSON: {e.msg} at char {e.pos}") from None
    if not isinstance(data, list):
        raise ConfigError("--tensor_upgrades must be a JSON list of {\"pattern\": ..., \"levels\": ...}")
    out = []
    for i, item in enumerate(data):
        if not isinstance(item, dict) or set(item) != {"pattern", "levels"}:
            raise ConfigError(f"--tensor_upgrades[{i}] must have exactly the keys 'pattern' and 'levels', got {item!r}")
        if not isinstance(item["pattern"], str):
            raise ConfigError(f"--tensor_upgrades[{i}].pattern must be a string")
        out.append(Upgrade(item["pattern"], item["levels"]))
    return tuple(out)


def upgrade_key(name: str) -> str:
    """The name every ``--tensor_upgrades`` pattern is matched against: the HF parameter name with
    its trailing ``.weight`` removed, so ``mlp\\.(gate|up|down)_proj$`` matches as written in the
    reference recipe. The one place that decides it (bake, repair, fill, polish, search)."""
    return name[: -len(".weight")] if name.endswith(".weight") else name


def matching_upgrades(name: str, upgrades: Sequence[Upgrade]) -> list[Upgrade]:
    key = upgrade_key(name)
    return [u for u in upgrades if u.matches(key)]


def is_pinned(name: str, upgrades: Sequence[Upgrade]) -> bool:
    """A tensor some ``--tensor_upgrades`` rule matches keeps the rung that rule gave it: repair,
    fill, polish and the search never move it."""
    return bool(matching_upgrades(name, upgrades))


def apply_upgrades(name: str, menu: Sequence[str], index: int, upgrades: Sequence[Upgrade]) -> int:
    """Move `index` along `menu` by every matching rule's levels (in order), clamped at its ends."""
    for up in matching_upgrades(name, upgrades):
        index = min(len(menu) - 1, max(0, index + up.levels))
    return index
