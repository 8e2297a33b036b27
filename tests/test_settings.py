"""Each setting declared once: the flags agree with the config dataclasses (name, default, type),
the keys read what each setting changes, and one idea has one name in every command."""

import dataclasses
import typing

import pytest
import typer
from typer.testing import CliRunner

from voodoo_quant.core import settings as S
from voodoo_quant.cli.app import app
from voodoo_quant.cli.options import ALIASES
from voodoo_quant.training.config import TrainConfig

GROUP = typer.main.get_command(app)


def _options(command):
    return {p.name: p for p in GROUP.commands[command].params if p.param_type_name == "option" and p.name != "help"}


def _plain(tp):
    """int, float, bool, str (Path and str enums count as str), list, or object (anything else)."""
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    if typing.get_origin(tp) in (typing.Union, getattr(__import__("types"), "UnionType")) and args:
        tp = args[0]
    if typing.get_origin(tp) in (list, tuple):
        return list
    if isinstance(tp, type):
        for t in (bool, int, float, str):
            if issubclass(tp, t):
                return t
        if issubclass(tp, __import__("pathlib").PurePath):
            return str
    return object


def _type(p):
    return _plain(p.type_descriptor.annotation)


def _field_type(tp):
    return _plain(tp)


# command -> (config dataclass, {option: field} where the names differ)
CONFIGS = {
    "train": ("voodoo_quant.training.config:TrainConfig", {}),
    "quantize": ("voodoo_quant.tools.quantize:QuantizeConfig", {"text": "texts", "eval_text": "eval_texts"}),
    "data": ("voodoo_quant.tools.data:DataConfig", {}),
    "make-teacher": ("voodoo_quant.tools.teacher:MakeTeacherConfig", {}),
    "precache": ("voodoo_quant.tools.precache:PrecacheConfig", {}),
    "export": ("voodoo_quant.tools.export:ExportConfig", {}),
    "eval": ("voodoo_quant.tools.evaluate:GGUFEvalConfig", {"gguf": "files"}),
    "doctor": ("voodoo_quant.tools.doctor:DoctorConfig", {}),
}


def _cls(spec):
    import importlib

    mod, name = spec.split(":")
    return getattr(importlib.import_module(mod), name)


@pytest.mark.parametrize("command", sorted(CONFIGS))
def test_every_flag_agrees_with_its_config_field(command):
    cls = _cls(CONFIGS[command][0])
    renamed = CONFIGS[command][1]
    fields = {f.name: f for f in dataclasses.fields(cls)}
    hints = typing.get_type_hints(cls)
    checked = 0
    for name, p in _options(command).items():
        fname = renamed.get(name, name)
        if fname not in fields:
            continue
        f = fields[fname]
        default = S.default_of(f)
        is_list = _field_type(hints[fname]) is list or p.multiple
        if not is_list and default is not dataclasses.MISSING and not p.required:
            got = p.default.value if hasattr(p.default, "value") else p.default
            want = default.value if hasattr(default, "value") else default
            if isinstance(want, type(got)) or got is None or want is None:
                assert got == want or (got is None and want is None), (command, name, got, want)
            else:
                assert str(got) == str(want), (command, name, got, want)
        assert _type(p) == _field_type(hints[fname]) or object in (_type(p), _field_type(hints[fname])), \
            (command, name, _type(p), _field_type(hints[fname]))
        checked += 1
    assert checked >= min(3, len(fields)), (command, checked)


def test_train_has_one_option_per_setting_and_nothing_else():
    opts = _options("train")
    declared = {f.name: s for f, s in S.declared(TrainConfig) if s.cli}
    assert set(opts) == set(declared)
    assert {f.name for f in dataclasses.fields(TrainConfig)} == set(declared)  # every field is a setting
    for name, s in declared.items():
        p = opts[name]
        assert p.opts[0] == f"--{name}"
        assert (p.help or "") == s.help
        assert p.hidden == (s.hidden or s.panel == S.EXPERIMENTAL)
        if s.panel == S.EXPERIMENTAL:
            assert s.lab and (p.help or "") and "docs/lab" not in p.help, name


def test_experimental_flags_are_hidden_and_still_work(monkeypatch):
    out = CliRunner().invoke(app, ["train", "--help"], env={"COLUMNS": "200"}).output
    for flag in ("--ptqr", "--st_gumbel_fraction", "--relaxation_gap", "--search_evals", "--sensitivity_kind",
                 "--no_compile"):
        assert flag not in out
    assert "Advanced" in out and "Experimental" not in out
    from voodoo_quant.cli.tp import parse_train_flags

    cfg = parse_train_flags(["--model", "m", "--compression_ratio", "0.5", "--ptqr", "--search_evals", "3",
                             "--no_compile", "--sensitivity_kind", "output", "--no_relaxation_gap"])
    assert cfg.ptqr and cfg.search_evals == 3 and cfg.no_compile and cfg.sensitivity_kind == "output"


def test_experimental_panel_is_shown_on_request():
    import subprocess
    import sys

    env = {"VOODOO_HELP_EXPERIMENTAL": "1", "COLUMNS": "200", "PATH": "/usr/bin:/bin"}
    out = subprocess.run([sys.executable, "-m", "voodoo_quant.cli.app", "train", "--help"], capture_output=True,
                         text=True, env={**__import__("os").environ, **env}).stdout
    assert "Experimental" in out and "--ptqr" in out and "--search_evals" in out


def test_main_panels_hold_about_twenty_flags():
    main = [s for f, s in S.declared(TrainConfig) if s.cli and not s.hidden
            and s.panel not in (S.ADVANCED, S.EXPERIMENTAL)]
    assert 15 <= len(main) <= 24, len(main)


def test_the_keys_read_what_each_setting_changes():
    # the lists these replaced, kept by hand before: the same sets
    assert set(TrainConfig.unchanged_by(S.TRAINING)) == {
        "output_dir", "output_name", "partial_save_interval", "resume", "dry_run", "no_compile",
        "gradient_checkpointing", "device", "device_map", "lazy", "loss_chunk_size", "teacher_device", "log_file",
        "finalize_from_partial", "resume_from_partial", "polish", "search_evals", "search_margin", "guarantee",
        "stock_references", "memory_check"}
    assert set(TrainConfig.unchanged_by(S.OUTPUT)) == {
        "partial_save_interval", "resume", "dry_run", "no_compile", "loss_chunk_size", "log_file", "memory_check"}
    base = TrainConfig(model="m", compression_ratio=0.5)
    # the hand-kept lists gave d474523a560d9871 with the "fixed" sweep the default, 27489d8d3b2bcbeb
    # with "ruled"; with "packed" the default the hash moves, so a journal of a run on candidates of
    # another walk is not resumed on these. Those were keys of the six-type default menu (filled);
    # the ten-type default moves them all: a journal of the six-type menu is not resumed on ten
    six = dataclasses.replace(base, candidate_types=("Q8_0", "Q5_K", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S"))
    assert six.fill_menus and six.result_hash() == "0d209504a62ba071"
    assert dataclasses.replace(six, compensation_sweep="ruled").result_hash() == "27489d8d3b2bcbeb"
    assert dataclasses.replace(six, compensation_sweep="fixed").result_hash() == "d474523a560d9871"
    assert base.result_hash() == "e3f01e9c8c24e143"
    assert dataclasses.replace(base, compensation_sweep="ruled").result_hash() == "c1bd5a85227b5508"
    assert dataclasses.replace(base, compensation_sweep="fixed").result_hash() == "47f47172b9eacf5d"
    for name in TrainConfig.unchanged_by(S.TRAINING):
        f = next(f for f in dataclasses.fields(TrainConfig) if f.name == name)
        if isinstance(S.default_of(f), bool):
            assert dataclasses.replace(base, **{name: not S.default_of(f)}).result_hash() == base.result_hash()
    # --memory_check is in neither key: a journal stays valid whichever value ran it
    assert dataclasses.replace(base, memory_check="off").result_hash() == base.result_hash()
    assert dataclasses.replace(base, max_steps=7).result_hash() != base.result_hash()
    assert TrainConfig(model="m", target_size="1GB").result_hash() != base.result_hash()


def test_one_idea_one_name_in_every_command():
    old = {"steps", "eval_ctx", "eval_chunks", "threads", "nproc", "world_size"}
    for name in GROUP.commands:
        visible = {k.lstrip("-").replace("-", "_") for p in GROUP.commands[name].params if not p.hidden
                   for k in [*p.opts, *getattr(p, "secondary_opts", [])]}
        assert not visible & old, (name, visible & old)
    assert ALIASES["quantize"] == {"steps": "max_steps", "eval_ctx": "ctx", "eval_chunks": "chunks",
                                   "threads": "workers"}
    from voodoo_quant.tools.quantize import QuantizeConfig

    seq = {c.__name__: S.default_of(next(f for f in dataclasses.fields(c) if f.name == "seq_len"))
           for c in (TrainConfig, QuantizeConfig)}
    assert len(set(seq.values())) == 1, seq


@pytest.mark.parametrize("command,args,param,value", [
    ("quantize", ["--steps", "7"], "max_steps", 7),
    ("quantize", ["--eval_ctx", "64", "--eval_chunks", "3", "--threads", "2"], "ctx", 64),
    ("quantize", ["--eval-chunks", "3"], "chunks", 3),
    ("eval", ["--threads", "3"], "workers", 3),
    ("tp", ["--nproc", "4"], "nproc", 4),
    ("doctor", ["--world_size", "4"], "tensor_parallel", 4),
    ("doctor", ["--world-size", "4"], "tensor_parallel", 4),
    ("train", ["--steps", "9"], "max_steps", 9),
])
def test_old_spellings_are_aliases(command, args, param, value):
    root = GROUP.make_context("voodoo", [command, *args])
    _, cmd, rest = GROUP.resolve_command(root, [command, *args])
    req = []
    for p in cmd.params:
        if p.param_type_name == "option" and p.required and p.name not in (param,):
            req += [p.opts[0], "1"]
    ctx = cmd.make_context(command, rest + req, parent=root)
    assert ctx.params[param] == value


def test_every_experiment_is_registered_with_its_settings_and_lab_entry():
    from pathlib import Path

    from voodoo_quant import experimental
    from voodoo_quant.training import methods
    from voodoo_quant.training.config import METHODS

    exp_settings = {s for e in experimental.REGISTRY.values() for s in e.settings}
    panel = {f.name for f, s in S.declared(TrainConfig) if s.panel == S.EXPERIMENTAL}
    assert exp_settings == panel
    labs = {f.name: s.lab for f, s in S.declared(TrainConfig)}
    for e in experimental.REGISTRY.values():
        assert (Path(__file__).parent.parent / e.lab).is_file(), e.lab
        assert all(labs[s] == e.lab for s in e.settings), e.name
    assert not experimental.active(TrainConfig(model="m", compression_ratio=0.5))
    assert [e.name for e in experimental.active(TrainConfig(model="m", compression_ratio=0.5, search_evals=2))] == ["search"]
    assert set(methods.RUNNERS) < set(METHODS)
    assert methods.runner_for(TrainConfig(model="m", compression_ratio=0.5)) is None
