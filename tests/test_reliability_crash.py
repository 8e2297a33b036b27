"""Crash and resume: `voodoo train` / `voodoo export` SIGKILLed at chosen points, then rerun.

Every run is the real CLI entry point in its own process, killed by SIGKILL (nothing gets to
clean up) through the test-only hook ``VOODOO_FAULT_AT`` (voodoo_quant/core/faults.py): mid-write of
a cache entry, after a step's update, mid-write of the journal, in bake, mid-write of the result,
mid-stream of the GGUF. After every kill, every file under a final name must be complete; the
chain of resumed runs must end with the assignment, gates and GGUF bytes of an uninterrupted run.

Processes are forked from one "zygote" that imported torch/transformers once (importing them
costs ~10 s per process on a busy 2-core machine); it runs no torch op before forking, so the
children start with no thread pools.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow

ZYGOTE = r"""
import json, os, sys
import torch, transformers  # noqa: F401  (the expensive imports, done once)
from transformers.models.llama import modeling_llama  # noqa: F401
import voodoo_quant.cli.app, voodoo_quant.training.trainer, voodoo_quant.tools.export  # noqa: F401
print(json.dumps({"ready": True}), flush=True)
for line in sys.stdin:
    job = json.loads(line)
    pid = os.fork()
    if pid == 0:
        os.environ.update(job["env"])
        fd = os.open(job["log"], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(fd, 1); os.dup2(fd, 2)
        sys.argv = ["voodoo", *job["argv"]]
        code = 0
        try:
            voodoo_quant.cli.app.main()
        except SystemExit as e:
            code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        except BaseException:
            import traceback; traceback.print_exc(); code = 99
        sys.stdout.flush(); sys.stderr.flush()
        os._exit(code)
    _, status = os.waitpid(pid, 0)
    sig = os.WTERMSIG(status) if os.WIFSIGNALED(status) else None
    rc = os.WEXITSTATUS(status) if os.WIFEXITED(status) else None
    print(json.dumps({"signal": sig, "rc": rc}), flush=True)
"""

MENU = ["Q8_0", "Q5_0", "Q4_0"]


class Zygote:
    def __init__(self, env: dict[str, str]):
        self.env = env
        self.p = subprocess.Popen([sys.executable, "-c", ZYGOTE], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                  text=True, env=dict(os.environ, **env))
        assert json.loads(self.p.stdout.readline()) == {"ready": True}
        self.runs = 0

    def run(self, argv: list[str], log: Path, fault: str | None = None) -> dict:
        env = dict(self.env)
        env["VOODOO_FAULT_AT"] = fault or ""
        self.p.stdin.write(json.dumps({"argv": argv, "env": env, "log": str(log)}) + "\n")
        self.p.stdin.flush()
        self.runs += 1
        return json.loads(self.p.stdout.readline())

    def close(self) -> None:
        self.p.stdin.close()
        self.p.wait(timeout=30)


@pytest.fixture(scope="module")
def crash_setup(tmp_path_factory, tiny_llama_hf_dir):
    d = tmp_path_factory.mktemp("crash")
    (d / "data").mkdir()
    g = torch.Generator().manual_seed(5)
    torch.save(torch.randint(0, 49152, (8, 32), generator=g), d / "data" / "train_tokens.pt")
    z = Zygote({"VOODOO_CACHE_DIR": str(d / "cache"), "VOODOO_QUANT_WORKERS": "1", "HF_HUB_OFFLINE": "1"})
    yield d, tiny_llama_hf_dir, z
    z.close()


def train_argv(model: Path, d: Path, out: Path) -> list[str]:
    return ["train", "--model", str(model), "--data_dir", str(d / "data"), "--seq_len", "32", "--batch_size", "2",
            "--max_steps", "6", "--compression_ratio", "0.7", "--candidate_types", *MENU,
            "--partial_save_interval", "1", "--output_dir", str(out)]


def final_files_intact(out: Path) -> list[str]:
    """Every file under a final name in a run dir is complete: returns the names checked."""
    from voodoo_quant.selection.assignment import Assignment
    from voodoo_quant.core.fileio import torch_load

    seen = []
    for f in sorted(out.iterdir()) if out.exists() else []:
        if f.name.startswith("."):
            continue  # a temporary: never a final name
        if f.suffix == ".pt":
            obj = torch_load(f)
            assert isinstance(obj, dict) and obj, f
        elif f.name == "assignment.json":
            assert Assignment.load(f).tensors
        elif f.suffix == ".jsonl":
            for ln in f.read_text().splitlines():
                json.loads(ln)  # a torn line would fail here
        elif f.suffix == ".txt":
            assert all("=" in ln for ln in f.read_text().splitlines())
        seen.append(f.name)
    return seen


def cache_intact(root: Path) -> int:
    """Every cache entry with a meta.json has a data.bin of exactly that length and sha256."""
    n = 0
    for meta in root.rglob("meta.json"):
        m = json.loads(meta.read_text())
        data = (meta.parent / "data.bin").read_bytes()
        assert len(data) == m["nbytes"] and hashlib.sha256(data).hexdigest() == m["sha256"], meta
        n += 1
    return n


def test_train_killed_at_every_stage_resumes_to_the_uninterrupted_result(crash_setup):
    d, model, z = crash_setup
    straight = z.run(train_argv(model, d, d / "straight"), d / "straight.log")
    assert straight == {"signal": None, "rc": 0}, (d / "straight.log").read_text()[-2000:]

    # The kill chain: each run resumes what the previous one left.
    out = d / "chain"
    chain = [
        ("write:meta.json:2", "cache entry write"),  # candidates are built into a fresh cache
        ("step:2", "a step"),
        ("write:partial.pt:2", "a journal write"),
        ("bake", "bake"),
        ("write:voodoo.pt", "the result write"),
    ]
    z.env["VOODOO_CACHE_DIR"] = str(d / "chain-cache")  # cold: the first kill lands in the cache build
    journal_steps = []
    for i, (fault, _what) in enumerate(chain):
        r = z.run(train_argv(model, d, out), d / f"chain{i}.log", fault=fault)
        assert r == {"signal": signal.SIGKILL, "rc": None}, (fault, r, (d / f"chain{i}.log").read_text()[-2000:])
        final_files_intact(out)
        assert cache_intact(d / "chain-cache") >= 1
        if (out / "partial.pt").exists():
            journal_steps.append(torch.load(out / "partial.pt", weights_only=True)["step"])
    # a killed journal write keeps the previous journal; bake and result writes see the last step
    assert journal_steps == [1, 2, 6, 6], journal_steps
    assert not (out / "voodoo.pt").exists()

    done = z.run(train_argv(model, d, out), d / "chain-final.log")
    assert done == {"signal": None, "rc": 0}, (d / "chain-final.log").read_text()[-2000:]
    assert sorted(final_files_intact(out)) == sorted(final_files_intact(d / "straight"))
    assert not [p.name for p in out.iterdir() if p.name.endswith(".tmp")]  # stale temporaries swept

    a = json.loads((d / "straight" / "assignment.json").read_text())
    b = json.loads((out / "assignment.json").read_text())
    assert a["tensors"] == b["tensors"] and a["total_bytes"] == b["total_bytes"]
    ga = torch.load(d / "straight" / "voodoo.pt", weights_only=True)["gates"]
    gb = torch.load(out / "voodoo.pt", weights_only=True)["gates"]
    assert ga.keys() == gb.keys() and all(torch.equal(ga[k], gb[k]) for k in ga)
    steps = [json.loads(ln)["step"] for ln in (out / "train_log.jsonl").read_text().splitlines()]
    assert steps == [1, 2, 3, 4, 5, 6]
    assert (out / "tensor-types.txt").read_bytes() == (d / "straight" / "tensor-types.txt").read_bytes()


def test_export_killed_mid_stream_leaves_no_gguf_and_reruns_to_identical_bytes(crash_setup):
    d, model, z = crash_setup
    asg = d / "straight" / "assignment.json"
    if not asg.exists():
        r = z.run(train_argv(model, d, d / "straight"), d / "straight.log")
        assert r["rc"] == 0
    argv = lambda out: ["export", "--model", str(model), "--assignment", str(asg), "--output_dir", str(out),  # noqa: E731
                        "--output_name", "tiny.gguf"]
    r = z.run(argv(d / "exp"), d / "exp0.log", fault="export:tensor:5")
    assert r == {"signal": signal.SIGKILL, "rc": None}, (d / "exp0.log").read_text()[-2000:]
    assert not (d / "exp" / "tiny.gguf").exists()
    partial = [p for p in (d / "exp").iterdir() if p.name.endswith(".tmp")]
    assert len(partial) == 1  # the killed stream, under a temporary name only
    r = z.run(argv(d / "exp"), d / "exp1.log")
    assert r == {"signal": None, "rc": 0}, (d / "exp1.log").read_text()[-2000:]
    assert not [p for p in (d / "exp").iterdir() if p.name.endswith(".tmp")]
    r = z.run(argv(d / "exp-straight"), d / "exp2.log")
    assert r == {"signal": None, "rc": 0}, (d / "exp2.log").read_text()[-2000:]
    got, want = (d / "exp" / "tiny.gguf").read_bytes(), (d / "exp-straight" / "tiny.gguf").read_bytes()
    assert len(got) == len(want) and got == want
    assert os.stat(d / "exp" / "tiny.gguf").st_mode & 0o044 == 0o044  # readable by others, as a shipped file must be
