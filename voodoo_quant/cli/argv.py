"""Argument normalization applied to a subcommand's arguments before Click parses them.

- Either spelling of a flag works: ``--size_weight`` and ``--size-weight`` both reach the option
  the command declares (the reference recipe spells flags in snake_case).
- Old spellings: a flag renamed so that one idea has one name in every command keeps its old
  name as an alias (``--steps`` for ``--max_steps``), rewritten here and not listed in ``--help``.
- Space-separated lists: a list flag (an option declared as a list, which Click takes once per
  occurrence) takes every value up to the next flag, ``--gguf a.gguf b.gguf`` as
  ``--gguf a.gguf --gguf b.gguf`` (``--candidate_types Q8_0 Q5_K IQ3_S``, as in the reference
  recipe). Which flags are lists is read from the command itself (:func:`declared_flags`).
Everything after a bare ``--`` is left untouched (``voodoo tp --tensor_parallel 4 -- <train flags>``
hands it to the train processes verbatim).
"""

from __future__ import annotations

from typing import Iterable, Sequence


class Flags(list):
    """A command's declared long and short flags; ``lists`` holds the keys (snake_case, without
    ``--``) of those that take several values, ``aliases`` its old spellings (key -> the key of
    the flag they stand for; ``cli/options.py``)."""

    lists: frozenset[str] = frozenset()
    aliases: dict[str, str] = {}


def _key(flag: str) -> str:
    return flag[2:].replace("-", "_")


def normalize(args: Sequence[str], known: Iterable[str]) -> list[str]:
    """Rewrite `args` for a command whose declared flags are `known` (:func:`declared_flags`)."""
    by_key = {_key(k): k for k in known if k.startswith("--")}
    for old, new in getattr(known, "aliases", {}).items():
        if old not in by_key and _key("--" + new) in by_key:
            by_key[old] = by_key[_key("--" + new)]
    lists = getattr(known, "lists", frozenset())
    out: list[str] = []
    args = list(args)
    i = 0
    while i < len(args):
        a = args[i]
        if a == "--":
            out.extend(args[i:])
            break
        if a.startswith("--") and len(a) > 2:
            name, eq, val = a.partition("=")
            declared = by_key.get(_key(name))
            if declared is not None:
                name = declared
                a = name + eq + val
            if declared is not None and _key(name) in lists and not eq:
                i += 1
                if i == len(args) or args[i].startswith("-"):
                    out.append(name)  # no value: Click says so
                    continue
                while i < len(args) and not args[i].startswith("-"):
                    out += [name, args[i]]
                    i += 1
                continue
        out.append(a)
        i += 1
    return out


def declared_flags(cmd) -> Flags:
    from .options import ALIASES  # lazy: cli.options imports this module

    flags, lists = Flags(), set()
    flags.aliases = dict(ALIASES.get(getattr(cmd, "name", None) or "", {}))
    for p in getattr(cmd, "params", []):
        opts = list(getattr(p, "opts", [])) + list(getattr(p, "secondary_opts", []))
        flags += opts
        if getattr(p, "multiple", False) and not getattr(p, "is_flag", False):
            lists.update(_key(o) for o in opts if o.startswith("--"))
    flags.lists = frozenset(lists)
    return flags
