"""`voodoo precache --error_compensation gptq`: the compensated candidates a training run uses.

Two ``--shard`` processes collect (the first) or reuse (the second) the run's Hessians in its
``--output_dir`` and fill one cache; train then finds its Hessians and every candidate there and
builds nothing; its candidates are byte for byte those a run building them itself makes."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from voodoo_quant.core.errors import ConfigError

ROOT = Path(__file__).resolve().parents[1]
MENU = ("Q8_0", "Q4_K", "Q4_0")


def _entries(root: Path) -> dict[str, bytes]:
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("data.bin"))}


def _precache(d: Path, cache: Path, out: Path, *extra: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "VOODOO_CACHE_DIR": str(cache), "PYTHONPATH": str(ROOT), "VOODOO_QUANT_WORKERS": "1"}
    return subprocess.run([sys.executable, "-m", "voodoo_quant.cli.app", "precache", "--model", str(d / "model"),
                           "--candidate_types", *MENU, "--workers", "1", "--error_compensation", "gptq",
                           "--output_dir", str(out), "--data_dir", str(d / "data"), "--seq_len", "32",
                           "--compensation_sequences", "3", *extra],
                          capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)


def _train(d: Path, out: Path):
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    return Trainer(TrainConfig(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=2,
                               compression_ratio=0.6, candidate_types=MENU, output_dir=str(out),
                               compensation_sequences=3, guarantee=False, search_evals=0)).train()  # auto: gptq


def test_precache_refuses_compensation_without_the_runs_inputs(gate_model_dir, tmp_path):
    from voodoo_quant.tools.precache import PrecacheConfig, precache

    with pytest.raises(ConfigError, match="--output_dir"):
        PrecacheConfig(model=str(gate_model_dir / "model"), error_compensation="gptq")
    with pytest.raises(ConfigError, match="none or gptq"):
        PrecacheConfig(model=str(gate_model_dir / "model"), error_compensation="auto", output_dir=str(tmp_path))
    cfg = PrecacheConfig(model=str(gate_model_dir / "model"), error_compensation="gptq", output_dir=str(tmp_path),
                         data_dir=str(tmp_path / "nowhere"), seq_len=32, candidate_types=MENU)
    with pytest.raises(ConfigError, match="training tokens .* are missing"):
        precache(cfg, progress=False)


@pytest.mark.slow
def test_precached_compensated_candidates_are_what_train_uses(gate_model_dir, tmp_path, monkeypatch, ggml_lib):
    from voodoo_quant.candidates import compensate
    from voodoo_quant.training import hessians, layer_hessians

    d, run = gate_model_dir, tmp_path / "run"
    first = _precache(d, tmp_path / "cache", run, "--shard", "1/2")
    assert first.returncode == 0, first.stderr[-3000:]
    hfile = run / "hessians.safetensors"
    made = hfile.stat().st_mtime_ns
    second = _precache(d, tmp_path / "cache", run, "--shard", "2/2")
    assert second.returncode == 0, second.stderr[-3000:]
    assert hfile.stat().st_mtime_ns == made  # the second shard reused the first one's Hessians (its key matched)
    filled = _entries(tmp_path / "cache")
    assert filled and ", 0 built" not in second.stdout

    # train on that cache: the Hessians file is reused, every candidate read, nothing computed
    def boom(*a, **k):
        raise AssertionError("train computed what precache had built")

    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path / "cache"))
    for mod, fn in ((compensate, "compensated"), (hessians, "collect_passes"),
                    (layer_hessians, "collect_layerwise")):
        monkeypatch.setattr(mod, fn, boom)
    res = _train(d, run)
    monkeypatch.undo()
    assert res.assignment.compensation["method"] == "gptq"
    assert _entries(tmp_path / "cache") == filled  # no entry added
    assert hfile.stat().st_mtime_ns == made

    # a run building its candidates itself, in an empty cache: the very same entries and bytes
    monkeypatch.setenv("VOODOO_CACHE_DIR", str(tmp_path / "own-cache"))
    own = _train(d, tmp_path / "own")
    assert _entries(tmp_path / "own-cache") == filled
    assert (tmp_path / "own" / "hessians.safetensors").read_bytes() == hfile.read_bytes()
    assert own.assignment.to_dict()["tensors"] == res.assignment.to_dict()["tensors"]
    assert {k: v for k, v in own.assignment.compensation.items() if k != "hessians"} == \
        {k: v for k, v in res.assignment.compensation.items() if k != "hessians"}
