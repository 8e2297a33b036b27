"""Every list flag of every command takes space-separated values (cli/argv.py).

The list flags are read from the Typer app itself (every option Click takes several times), so a
list flag added to any command is covered without editing this file."""

import pytest
import typer
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.cli.options import ALIASES

GROUP = typer.main.get_command(app)


def _list_flags() -> list[tuple[str, str]]:
    out = []
    for name, cmd in GROUP.commands.items():
        for p in cmd.params:
            if p.param_type_name == "option" and (p.multiple or p.nargs != 1):
                out.append((name, p.name))
    return out


LIST_FLAGS = _list_flags()


def _parse(command: str, args: list[str]):
    """`voodoo <command> <args>` parsed as the app parses it (the group normalizes the arguments),
    without running the command."""
    root = GROUP.make_context("voodoo", [command, *args])
    _, cmd, rest = GROUP.resolve_command(root, [command, *args])
    return cmd.make_context(command, rest, parent=root)


def _required(cmd, but: str) -> list[str]:
    """Placeholder values of the command's required options ("1" parses as text, path and number)."""
    out = []
    for p in cmd.params:
        if p.param_type_name == "option" and p.required and p.name != but:
            out += [p.opts[0], "1"]
    return out


def test_the_list_flags_are_found():
    # what the README promises, among what the app declares
    for flag in (("eval", "gguf"), ("quantize", "text"), ("quantize", "sizes"), ("data", "eval_files"),
                 ("train", "candidate_types"), ("train", "stock_references"), ("precache", "candidate_types"),
                 ("quantize", "stock")):
        assert flag in LIST_FLAGS, flag


@pytest.mark.parametrize("command,param", LIST_FLAGS, ids=[f"{c}--{p}" for c, p in LIST_FLAGS])
def test_every_list_flag_takes_space_separated_values(command, param):
    cmd = GROUP.commands[command]
    opt = next(p for p in cmd.params if p.name == param)
    old = {"--" + k for k, v in ALIASES.get(command, {}).items() if v == param}  # hidden aliases too
    for spelling in {opt.opts[0], "--" + param, "--" + param.replace("_", "-"), *old}:
        # the values stop at the next flag, which still parses as one
        ctx = _parse(command, [spelling, "1", "2", "3", *_required(cmd, param)])
        assert [str(v) for v in ctx.params[param]] == ["1", "2", "3"], (spelling, ctx.params[param])
        # repeated occurrences and one value keep working
        ctx = _parse(command, [spelling, "1", spelling, "2", *_required(cmd, param)])
        assert [str(v) for v in ctx.params[param]] == ["1", "2"]
        ctx = _parse(command, [*_required(cmd, param), spelling, "1"])
        assert [str(v) for v in ctx.params[param]] == ["1"]


def test_eval_takes_several_ggufs_after_one_flag(tmp_path):
    # Parsed as three files, then refused by the command for want of --reference (not a usage error).
    res = CliRunner().invoke(app, ["eval", "--gguf", "a.gguf", "b.gguf", "c.gguf"])
    assert res.exit_code == 2, res.output
    assert "unexpected extra argument" not in res.output
    assert "--gguf needs --reference" in res.output


def test_train_list_flags_reach_the_config():
    from voodoo_quant.cli.tp import parse_train_flags

    cfg = parse_train_flags(["--model", "m", "--compression_ratio", "0.5", "--candidate_types", "Q8_0", "q4_k",
                             "--stock_references", "Q4_K_M", "Q5_K_M", "--attention_candidates", "Q8_0,Q6_K"])
    assert cfg.candidate_types == ("Q8_0", "Q4_K")
    assert cfg.stock_references == ("Q4_K_M", "Q5_K_M")
    assert cfg.attention_candidates == ("Q8_0", "Q6_K")
    assert parse_train_flags(["--model", "m", "--compression_ratio", "0.5"]).stock_references  # default: all


TRAIN_LISTS = [p for c, p in LIST_FLAGS if c == "train"]


@pytest.mark.parametrize("param", TRAIN_LISTS)
def test_train_list_flags_after_voodoo_tp_take_space_separated_values(param):
    # `voodoo tp ... -- <train flags>` hands train's flags to cli/tp.parse_train_flags, which normalizes
    # them itself (the group only sees tp's own): every train list flag, as `voodoo train` takes it
    import dataclasses

    from voodoo_quant.cli.tp import parse_train_flags
    from voodoo_quant.core import settings as S
    from voodoo_quant.training.config import TrainConfig

    default = {f.name: S.default_of(f) for f in dataclasses.fields(TrainConfig)}
    values = list((default[param] or default["candidate_types"])[:3])  # valid ones: the first three defaults
    assert len(values) == 3, (param, values)
    train = ["--model", "m", "--compression_ratio", "0.5", "--" + param, *values, "--seed", "3"]
    tp = _parse("tp", ["--tensor_parallel", "2", "--", *train])
    assert tp.params["nproc"] == 2
    cfg = parse_train_flags(list(tp.args))
    assert list(getattr(cfg, param)) == values and cfg.seed == 3, getattr(cfg, param)
    assert [str(v) for v in _parse("train", train).params[param]] == values  # the same through `voodoo train`


def test_no_list_flag_is_declared_as_one_string():
    # A flag whose help promises several values is a list flag (else only its first value parses).
    for name, cmd in GROUP.commands.items():
        for p in cmd.params:
            if p.param_type_name == "option" and not (p.multiple or p.nargs != 1):
                assert "separated" not in (p.help or ""), (name, p.name, p.help)
