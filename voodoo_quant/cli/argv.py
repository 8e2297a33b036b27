"""Argument normalization applied to a subcommand's arguments before Click parses them.

- Either spelling of a flag works: ``--size_weight`` and ``--size-weight`` both reach the option
  the command declares (the reference recipe spells flags in snake_case).
- Space-separated lists after a list flag (``--candidate_types Q8_0 Q5_K IQ3_S``, as in the
  reference recipe) are joined into one comma-separated value, since a Click option takes one
  value per occurrence.
Everything after a bare ``--`` is left untouched (``voodoo tp --nproc 4 -- <train flags>``
hands it to the train processes verbatim).
"""

from __future__ import annotations

from typing import Iterable, Sequence

LIST_FLAGS = frozenset({"candidate_types", "attention_candidates", "non_attention_candidates",
                        "sizes", "stock", "text", "eval_text"})  # the last four: `voodoo quantize`


def _key(flag: str) -> str:
    return flag[2:].replace("-", "_")


def normalize(args: Sequence[str], known: Iterable[str]) -> list[str]:
    """Rewrite `args` for a command whose declared long options are `known`."""
    by_key = {_key(k): k for k in known if k.startswith("--")}
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
            if declared is not None and _key(name) in LIST_FLAGS and not eq:
                vals = []
                i += 1
                while i < len(args) and not args[i].startswith("-"):
                    vals.append(args[i])
                    i += 1
                out += [name, ",".join(vals)]
                continue
        out.append(a)
        i += 1
    return out


def declared_flags(cmd) -> list[str]:
    flags: list[str] = []
    for p in getattr(cmd, "params", []):
        flags += list(getattr(p, "opts", [])) + list(getattr(p, "secondary_opts", []))
    return flags
