"""Each setting declared once: a config dataclass field carries what its flag needs.

A field declared with :func:`setting` holds, beside its default, the flag's help text, the help
panel it is listed in, its old spellings (accepted, not shown) and what it changes:

- ``TRAINING``: the trained gates (the journal's ``result_hash``: a run resumes only with the same);
- ``OUTPUT``: what a finished run writes, not the training (where the bake looks, which
  references it measures, which device computes it: a journal stays valid across them, a ladder's
  cached step does not);
- ``NOTHING``: neither (how often the journal is written, where the log goes, chunking that is an
  exact reformulation).

The CLI options (``cli/options.py``), the Python API (the dataclass itself), the journal key and
the ladder's cache key (``tools/quantize.py``) are all read from it, so a setting cannot be added
to one and forgotten in another.
"""

from __future__ import annotations

import dataclasses
from dataclasses import MISSING, dataclass
from typing import Any, Callable

TRAINING, OUTPUT, NOTHING = "training", "output", "nothing"

# Help panels. The main ones are a command's own; these two are shared by every command.
ADVANCED = "Advanced"
EXPERIMENTAL = "Experimental"


@dataclass(frozen=True)
class Setting:
    help: str
    panel: str | None = None  # rich help panel; None: the command's "Options"
    changes: str = TRAINING  # TRAINING, OUTPUT or NOTHING (above)
    aliases: tuple[str, ...] = ()  # old spellings (snake_case, no dashes): accepted, hidden from --help
    negatable: bool | None = None  # a bool flag with its --no_ twin; None: when the default is not False
    cli: bool = True  # False: Python API only (no flag)
    hidden: bool = False  # accepted, not listed (a no-op kept for old command lines)
    lab: str | None = None  # experimental: the docs/lab entry that measured it
    metavar: str | None = None
    required: bool = False  # the flag must be given (the dataclass refuses its empty default)
    omit_at_default: bool = False  # a setting added later: left out of the keys at its default, so
    #                                journals and ladders made before it stay valid

    def __post_init__(self) -> None:
        assert self.changes in (TRAINING, OUTPUT, NOTHING), self.changes
        assert self.lab is None or self.panel == EXPERIMENTAL, "only an experimental setting cites a lab entry"


def setting(default: Any = MISSING, *, help: str, default_factory: Callable[[], Any] | Any = MISSING,
            **kw: Any) -> Any:
    """A dataclass field declared with its flag (see :class:`Setting` for the keywords)."""
    return dataclasses.field(default=default, default_factory=default_factory,
                             metadata={"setting": Setting(help=help, **kw)})


def of(field: dataclasses.Field) -> Setting | None:
    return field.metadata.get("setting")


def declared(cls) -> list[tuple[dataclasses.Field, Setting]]:
    """The fields of `cls` declared with :func:`setting`, in declaration order."""
    return [(f, of(f)) for f in dataclasses.fields(cls) if of(f) is not None]


def default_of(field: dataclasses.Field) -> Any:
    if field.default is not MISSING:
        return field.default
    if field.default_factory is not MISSING:
        return field.default_factory()
    return MISSING


def unchanged_by(cls, what: str) -> tuple[str, ...]:
    """The settings of `cls` that do not change `what` (TRAINING or OUTPUT)."""
    below = {TRAINING: (OUTPUT, NOTHING), OUTPUT: (NOTHING,)}[what]
    return tuple(f.name for f, s in declared(cls) if s.changes in below)


def key_dict(cfg, what: str) -> dict[str, Any]:
    """``cfg.to_dict()`` without the settings that do not change `what`, and without those
    added later (``omit_at_default``) while at their default."""
    skip = set(unchanged_by(type(cfg), what))
    d = cfg.to_dict()
    for f, s in declared(type(cfg)):
        if s.omit_at_default and d.get(f.name) == default_of(f):
            skip.add(f.name)
    return {k: v for k, v in d.items() if k not in skip}
