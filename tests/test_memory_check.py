"""A real run checks its memory plan before it loads anything (``--memory_check``, tools/memory_check.py).

On tiny random models with a device size forced through VOODOO_DEVICE_MEMORY_GB: where the eager
run does not fit and ``--lazy --gradient_checkpointing`` does, ``auto`` turns them on, says so, and
writes the bytes of the run given those flags; where nothing that keeps the result fits, the run
stops with the typed error before a candidate is built; ``off`` runs as given. And the premise:
``--gradient_checkpointing`` keeps the result (gates, losses, assignment) bit for bit on the CPU in
one process without a tied gated weight, so auto may turn it on there and nowhere else."""

from __future__ import annotations

import json
import logging
import sys
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import fileio
from voodoo_quant.core.errors import MemoryFitError
from voodoo_quant.core.units import GB
from voodoo_quant.memory.dry_run import dry_run
from voodoo_quant.tools.memory_check import check_memory, gb_text

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402

runner = CliRunner()
LOGGER = "voodoo_quant.tools.memory_check"


@pytest.fixture(scope="module")
def memcheck_models(tmp_path_factory):
    """qwen3: untied embedding / head; llama: tied (one MixedQuant on two modules)."""
    return tp_case.build_models(tmp_path_factory.mktemp("memcheck"), ("qwen3", "llama"))


def _cfg(d: Path, out: Path, **kw):
    return tp_case.config(d, out, 1, max_steps=2, **kw)


def _argv(d: Path, out: Path, *extra: str) -> list[str]:
    """`voodoo train` flags of :func:`_cfg`."""
    return ["train", "--model", str(d / "model"), "--data_dir", str(d / "data"), "--seq_len", "32", "--batch_size", "2",
            "--max_steps", "2", "--compression_ratio", "0.62", "--candidate_types", *tp_case.MENU,
            "--loss_chunk_size", "24", "--lr", "0.5", "--no_guarantee", "--search_evals", "0",
            "--error_compensation", "none", "--output_dir", str(out), *extra]


def _needs(d: Path, tmp: Path) -> dict[str, float]:
    """The plan's device peak (bytes) of each combination of the two settings."""
    out = {}
    for name, kw in (("eager", {}), ("lazy", {"lazy": True}), ("ckpt", {"gradient_checkpointing": True}),
                     ("both", {"lazy": True, "gradient_checkpointing": True})):
        out[name] = dry_run(_cfg(d, tmp, **kw)).memory.device_total
    return out


def _capacity_gb(limit: float) -> str:
    """VOODOO_DEVICE_MEMORY_GB whose 90 % (MemoryPlan.fits) is `limit` bytes."""
    return repr(limit / 0.9 / GB)


def _result(out: Path) -> tuple[dict, dict, dict]:
    """(tensor -> (type, candidate sha256), gates, config) of a finished run."""
    asg = json.loads((out / "assignment.json").read_text())
    pt = fileio.torch_load(out / "voodoo.pt", what="result")
    types = {n: (t["qtype"], t["sha256"]) for n, t in asg["tensors"].items()}
    return types, pt["gates"], json.loads(pt["config_json"])


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_auto_turns_on_lazy_and_checkpointing_and_writes_the_explicit_runs_bytes(memcheck_models, tmp_path,
                                                                                   monkeypatch, caplog, ggml_lib):
    from voodoo_quant.training import journal
    from voodoo_quant.training.trainer import Trainer

    d = memcheck_models["qwen3"]
    need = _needs(d, tmp_path / "plan")
    assert need["both"] < min(need["lazy"], need["ckpt"]) < need["eager"]  # the premise of the capacity below
    monkeypatch.setenv("VOODOO_DEVICE_MEMORY_GB", _capacity_gb((need["both"] + min(need["lazy"], need["ckpt"])) / 2))
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        r = runner.invoke(app, _argv(d, tmp_path / "auto"))
    assert r.exit_code == 0, r.output
    said = [rec.getMessage() for rec in caplog.records if rec.name == LOGGER]
    assert len(said) == 1, said  # one line: the need, what it turns on, what that needs
    assert "turning on --lazy --gradient_checkpointing" in said[0] and gb_text(need['eager']) in said[0]
    assert f"{gb_text(need['both'])}, fits" in said[0]
    explicit = Trainer(_cfg(d, tmp_path / "explicit", lazy=True, gradient_checkpointing=True,
                            memory_check="off")).train()
    assert explicit.output_pt.is_file()
    auto_types, auto_gates, auto_cfg = _result(tmp_path / "auto")
    types, gates, _ = _result(tmp_path / "explicit")
    assert auto_types == types and _same(auto_gates, gates)
    # what the run used is what it records: the result's config and the journal's
    assert auto_cfg["lazy"] and auto_cfg["gradient_checkpointing"] and auto_cfg["memory_check"] == "auto"
    eager = _cfg(d, tmp_path / "auto")
    st = journal.load(tmp_path / "auto" / journal.JOURNAL_NAME, expect_hash=eager.result_hash(),  # resumable as given
                      expect_names=set(auto_gates))
    assert st.config["lazy"] and st.config["gradient_checkpointing"]


def test_nothing_that_keeps_the_result_fits_stops_before_any_candidate(memcheck_models, tmp_path, monkeypatch,
                                                                       ggml_lib):
    d = memcheck_models["qwen3"]
    need = _needs(d, tmp_path / "plan")
    monkeypatch.setenv("VOODOO_DEVICE_MEMORY_GB", _capacity_gb(need["both"] * 0.8))
    cache = tmp_path / "cache"
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(cache))
    r = runner.invoke(app, _argv(d, tmp_path / "out"))
    assert r.exit_code == 1, r.output
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: memory plan: this run needs"), r.stderr
    assert gb_text(need['eager']) in lines[0] and "--lazy --gradient_checkpointing" in lines[0]
    assert "change: " in lines[0] and "--memory_check off" in lines[0]
    assert not any(cache.rglob("*")) if cache.exists() else True  # no candidate was built
    assert not (tmp_path / "out" / "partial.pt").exists()
    with pytest.raises(MemoryFitError, match="do not make it fit"):  # the API's road: the typed error
        check_memory(_cfg(d, tmp_path / "api"))
    # warn: says so and goes on as given
    warned = check_memory(_cfg(d, tmp_path / "api", memory_check="warn"))
    assert not warned.applied and not warned.cfg.lazy and "running as given" in warned.message


def test_off_runs_as_given(memcheck_models, tmp_path, monkeypatch, ggml_lib):
    d = memcheck_models["qwen3"]
    monkeypatch.setenv("VOODOO_DEVICE_MEMORY_GB", "0.000001")  # nothing fits
    r = runner.invoke(app, _argv(d, tmp_path / "off", "--memory_check", "off"))
    assert r.exit_code == 0, r.output
    _, _, cfg = _result(tmp_path / "off")
    assert not cfg["lazy"] and not cfg["gradient_checkpointing"]


def test_a_tied_gated_weight_gets_lazy_alone(memcheck_models, tmp_path, monkeypatch):
    """With a tied embedding / head, checkpointing sums the tied gate's two gradients in another
    order (tests/test_mix_per_layer.py): advised, never turned on for the user."""
    d = memcheck_models["llama"]
    need = _needs(d, tmp_path)
    assert need["both"] < need["lazy"] < need["eager"]
    monkeypatch.setenv("VOODOO_DEVICE_MEMORY_GB", _capacity_gb((need["both"] + need["lazy"]) / 2))
    with pytest.raises(MemoryFitError, match="tied") as e:
        check_memory(_cfg(d, tmp_path))
    assert "--gradient_checkpointing:" in str(e.value)  # in the advice
    monkeypatch.setenv("VOODOO_DEVICE_MEMORY_GB", _capacity_gb((need["lazy"] + need["eager"]) / 2))
    got = check_memory(_cfg(d, tmp_path))
    assert got.applied == {"lazy": True} and got.cfg.lazy and not got.cfg.gradient_checkpointing


@pytest.mark.parametrize("lazy", [False, True])
def test_checkpointing_keeps_the_result_untied_on_the_cpu(memcheck_models, tmp_path, lazy, ggml_lib):
    """The premise of turning --gradient_checkpointing on: the same losses, gates and assignment."""
    from voodoo_quant.training.trainer import Trainer

    d = memcheck_models["qwen3"]
    runs = [Trainer(_cfg(d, tmp_path / str(ck), lazy=lazy, gradient_checkpointing=ck, memory_check="off")).train()
            for ck in (False, True)]
    assert [(h.ce, h.kl) for h in runs[0].history] == [(h.ce, h.kl) for h in runs[1].history]
    a, b = (_result(r.output_pt.parent) for r in runs)
    assert a[0] == b[0] and _same(a[1], b[1])
