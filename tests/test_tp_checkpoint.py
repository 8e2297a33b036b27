"""Under tensor parallelism + --gradient_checkpointing each rank keeps only its 1/world slice of
every decoder layer's input and all-gathers it before the backward recompute (tp_checkpoint.py):
the same losses and gate gradients, bit for bit, as the ordinary checkpoint (2 gloo ranks)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(Path(__file__).parent / "helpers"))


@pytest.fixture(scope="module")
def models(tmp_path_factory):
    from tp_case import build_models

    root = tmp_path_factory.mktemp("tpckpt")
    build_models(root, ("qwen3_5",))
    return root


def test_partitioned_checkpoint_gives_the_same_gradients(models, tmp_path, ggml_lib):
    env = dict(os.environ, OMP_NUM_THREADS="1", VOODOO_QUANT_WORKERS="1", PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(ROOT / "tests" / "helpers" / "tp_ckpt_case.py"), str(models), str(tmp_path)],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=600)
    written = sorted(f.name for f in tmp_path.glob("rank*.pt"))  # an abort before or after the outputs
    assert p.returncode == 0, (written, (p.stdout + p.stderr)[-4000:])
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=True) for r in range(2)]
    for r, res in enumerate(ranks):
        assert res["layers"] == 2 and res["n_partitioned"] == 2, r  # every decoder layer, on every rank
        assert res["packed_teacher"] >= 10, r  # --lazy + Q8_0: the rank's teacher shards held packed
        part, plain = res["runs"]["partitioned"], res["runs"]["plain"]
        assert (part["ce"], part["kl"]) == (plain["ce"], plain["kl"]), r
        assert set(part["grads"]) == set(plain["grads"])
        for n in plain["grads"]:
            assert torch.equal(part["grads"][n], plain["grads"][n]), (r, n)
        assert any(g.abs().max() > 0 for g in part["grads"].values())
