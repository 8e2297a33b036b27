"""`voodoo doctor` through Typer's CliRunner, and the report it is built from."""

from __future__ import annotations

import json

import pytest
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import paths
from voodoo_quant.core.errors import ConfigError
from voodoo_quant.tools.doctor import DoctorConfig, run_doctor


def _tools_built() -> bool:
    return all((paths.llama_cpp_dir() / "build" / "bin" / t).is_file() for t in paths.STOCK_TOOLS)


def test_json_report_content(monkeypatch):
    monkeypatch.delenv("VOODOO_GGML_LIB", raising=False)
    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "3")
    r = CliRunner().invoke(app, ["doctor", "--json"])
    data = json.loads(r.stdout)
    checks = {c["name"]: c for c in data["checks"]}
    for name in ("python", "torch", "accelerator", "attention backend", "libggml-base",
                 "convert_hf_to_gguf.py", *paths.STOCK_TOOLS, "VOODOO_GGML_LIB", "tp env OMP_NUM_THREADS"):
        assert name in checks, name
    assert checks["libggml-base"]["status"] == "ok" and "type table matches" in checks["libggml-base"]["reason"]
    assert checks["accelerator"]["reason"]  # detection always says why
    assert checks["VOODOO_QUANT_WORKERS"]["detail"] == "3"
    # Exit code follows the required checks: the tools are required.
    assert data["ok"] == _tools_built()
    assert r.exit_code == (0 if data["ok"] else 1)


def test_table_render(monkeypatch):
    monkeypatch.delenv("VOODOO_GGML_LIB", raising=False)
    r = CliRunner().invoke(app, ["doctor"], env={"COLUMNS": "200"})
    assert "voodoo doctor" in r.stdout and "libggml-base" in r.stdout and "llama-quantize" in r.stdout
    assert r.exit_code == (0 if _tools_built() else 1)


def test_missing_libggml_fails_with_one_line(monkeypatch, tmp_path):
    missing = tmp_path / "nope" / "libggml-base.so"
    monkeypatch.setenv("VOODOO_GGML_LIB", str(missing))
    r = CliRunner().invoke(app, ["doctor", "--json"])
    assert r.exit_code == 1
    data = json.loads(r.stdout)
    lib = next(c for c in data["checks"] if c["name"] == "libggml-base")
    assert lib["status"] == "missing" and lib["failed"] and str(missing) in lib["reason"]
    lines = [ln for ln in r.stderr.splitlines() if "libggml-base" in ln]
    assert len(lines) == 1 and lines[0].startswith("error: libggml-base missing:")
    assert str(missing) in lines[0] and "VOODOO_GGML_LIB" in lines[0]


def test_bad_variable_is_a_warning_not_a_crash(monkeypatch):
    monkeypatch.setenv("VOODOO_QUANT_WORKERS", "many")
    rep = run_doctor(environ={"VOODOO_QUANT_WORKERS": "many", "OMP_NUM_THREADS": "7"})
    by = {c.name: c for c in rep.checks}
    assert by["VOODOO_QUANT_WORKERS"].status == "warn" and "not an integer" in by["VOODOO_QUANT_WORKERS"].reason
    assert by["tp env OMP_NUM_THREADS"].status == "warn" and "7 (yours, kept" in by["tp env OMP_NUM_THREADS"].detail


def test_world_size_validated():
    with pytest.raises(ConfigError):
        DoctorConfig(tensor_parallel=0)
    # the one name of the degree, and the old spellings (the reference launcher's --world-size)
    for flag in ("--tensor_parallel", "--tensor-parallel", "--world_size", "--world-size", "--nproc"):
        r = CliRunner().invoke(app, ["doctor", flag, "0"])
        assert r.exit_code == 2 and "--tensor_parallel must be >= 1" in r.stderr, (flag, r.output)