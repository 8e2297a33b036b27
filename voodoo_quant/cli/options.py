"""A command's options generated from its config dataclass (``settings.py``).

Typer builds a command from a function's signature; :func:`from_config` writes that signature
from the dataclass's fields: one ``typer.Option`` per setting with its help, panel, default and
type, ``--x/--no_x`` for a bool whose default is not False, a list for a tuple of names. Old
spellings (``aliases``) are not options: ``cli/argv.py`` rewrites them to the flag before Click
parses (:data:`ALIASES`), so ``--help`` lists one spelling. Experimental settings are hidden
unless ``VOODOO_HELP_EXPERIMENTAL=1`` (they work either way).
"""

from __future__ import annotations

import dataclasses
import inspect
import types
import typing
from typing import Any, Callable, List, Optional

import typer

from ..core import envs
from ..core.settings import ADVANCED, EXPERIMENTAL, Setting, declared, default_of

# command name -> {old spelling (snake_case): the flag it stands for (snake_case)}
ALIASES: dict[str, dict[str, str]] = {}


def add_aliases(command: str, mapping: dict[str, str]) -> None:
    ALIASES.setdefault(command, {}).update(mapping)


def _base(tp: Any) -> tuple[Any, bool]:
    """(the type without None, whether None was allowed)."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0], True
    return tp, False


def cli_type(tp: Any) -> tuple[Any, bool]:
    """(the annotation Typer gets for a field of type `tp`, whether it is a list flag)."""
    base, _ = _base(tp)
    if typing.get_origin(base) in (tuple, list):
        return Optional[List[str]], True
    return Optional[base], False


def option(name: str, field: dataclasses.Field, s: Setting, tp: Any) -> inspect.Parameter:
    annotation, is_list = cli_type(tp)
    default = default_of(field)
    base, _ = _base(tp)
    flag = f"--{name}"
    if base is bool and (s.negatable or (s.negatable is None and default is not False)):
        flag = f"--{name}/--no_{name}"
    cli_default = None if is_list or default is dataclasses.MISSING else default
    if s.required:
        cli_default = ...
    if base is bool and default is not None:
        annotation = bool
    elif default is not None and not is_list and default is not dataclasses.MISSING:
        annotation = base
    hidden = s.hidden or (s.panel == EXPERIMENTAL and not envs.help_experimental())
    opt = typer.Option(cli_default, flag, help=s.help, rich_help_panel=s.panel, hidden=hidden, metavar=s.metavar,
                       show_default=not is_list)
    return inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY, default=opt, annotation=annotation)


def from_config(cls, command: str, *, exclude: tuple[str, ...] = (),
                before: tuple[inspect.Parameter, ...] = ()) -> Callable[[Callable], Callable]:
    """Decorate a command body ``fn(**settings)``: its signature becomes one option per setting
    of `cls` (except `exclude`), after `before`; the aliases go to :data:`ALIASES`."""
    hints = typing.get_type_hints(cls)
    params = list(before)
    rank = {ADVANCED: 1, EXPERIMENTAL: 2}  # the main panels first, in the order the fields meet them
    fields = [(f, s) for f, s in declared(cls) if f.name not in exclude and s.cli]
    for f, s in sorted(fields, key=lambda fs: rank.get(fs[1].panel, 0)):
        params.append(option(f.name, f, s, hints[f.name]))
        add_aliases(command, {a: f.name for a in s.aliases})

    def wrap(fn: Callable) -> Callable:
        fn.__signature__ = inspect.Signature(params)
        fn.__annotations__ = {}
        return fn

    return wrap


def config_kwargs(cls, values: dict[str, Any]) -> dict[str, Any]:
    """The keyword arguments of `cls` from parsed option `values`: an option left unset (None, or
    an empty list) where the field's default is not None is left out, so the dataclass's own
    default applies."""
    out = {}
    for f, s in declared(cls):
        if f.name not in values:
            continue
        v = values[f.name]
        if isinstance(v, (list, tuple)) and not v:
            v = None
        if v is None and default_of(f) is not None:
            continue
        out[f.name] = v
    return out


def flag_type_of(param) -> type:
    """The Python type a Click option of a generated or hand-written command converts to."""
    t = getattr(param, "type", None)
    return {"integer": int, "float": float, "boolean": bool, "text": str}.get(getattr(t, "name", ""), object)
