"""Speed and memory, side by side in one run, printed as ratios (and the numbers they come from).

1. Candidate cache vs ``llama-quantize`` on the same tensors and types, and 1 → 2 worker
   scaling: ``bench/speed_cache.py`` (run as is, its report passed through).
2. A training step vs a plain student step at the same shape: the trainer's step (gated
   mixtures of the frozen candidates, CE + λ·KL vs the teacher's logits, backward to the gates,
   Adam on the gates) against the same HF model with its float weights requiring grad, one
   forward + backward with the same loss (``training.losses.distill_terms``), same tokens,
   seq_len and batch. Median over steps after a warm-up step.
3. Peak memory eager vs ``--lazy``: ru_maxrss of a ``voodoo train --max_steps 2`` process (loads
   the model and teacher, builds the student from a warm candidate cache, runs 2 steps), each in
   its own process, launched by a fresh small Python that reads it with ``os.wait4`` (a child
   forked from this bench would inherit the bench's own RSS peak: Linux keeps it across exec);
   also the train process's own peak by step 2, as the trainer logs it.

The model is a random Llama with SmolLM2-135M's widths (``--layers`` of them) unless ``--model``
gives an HF checkpoint dir; tokens are random. Every cache and output goes to a temp dir.

    .venv/bin/python bench/speed.py [--layers 4] [--seq_len 256] [--skip_cache] [--model DIR]
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")
# What the `voodoo` CLI applies to its own process (huge pages for torch's CPU tensors): the
# in-process trainer here runs as the CLI's does. Before torch allocates anything large.
from voodoo_quant.hardware.envdefaults import apply_env_defaults, host_env_defaults  # noqa: E402

apply_env_defaults(host_env_defaults(), os.environ)

MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_XS", "IQ4_NL", "Q3_K", "IQ3_S", "IQ2_S")


def make_model(d: Path, a: argparse.Namespace) -> Path:
    """A random Llama (SmolLM2-135M's widths, tied embeddings) saved as an HF dir."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from voodoo_quant.model.modeling import load_tokenizer
    from voodoo_quant.tools.embedded import smollm2_gguf_path

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                      num_hidden_layers=a.layers, num_attention_heads=a.hidden // 64,
                      num_key_value_heads=max(1, a.hidden // 192), head_dim=64, tie_word_embeddings=True,
                      bos_token_id=1, eos_token_id=2)
    hf = d / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf)
    load_tokenizer(smollm2_gguf_path()).save_pretrained(hf)
    return hf


def make_tokens(d: Path, vocab: int, seq_len: int, n: int) -> Path:
    import torch

    from voodoo_quant.core import fileio

    g = torch.Generator().manual_seed(0)
    return fileio.torch_save(d / "data" / "train_tokens.pt", torch.randint(0, vocab, (n, seq_len), generator=g))


def run_cli(args: list, log: Path) -> str:
    argv = [str(Path(sys.executable).with_name("voodoo")), *map(str, args)]
    p = subprocess.run(argv, capture_output=True, text=True, env=dict(os.environ, GGML_NO_BACKTRACE="1"))
    log.write_text(p.stdout + p.stderr)
    if p.returncode:
        raise SystemExit(f"{' '.join(argv[:2])} failed (exit {p.returncode}); see {log}:\n{p.stderr[-1500:]}")
    return p.stdout


def train_args(hf: Path, work: Path, a: argparse.Namespace, steps: int, out: str) -> list:
    return ["train", "--model", hf, "--data_dir", work / "data", "--imatrix", work / "imatrix.gguf",
            "--compression_ratio", "0.60", "--seq_len", a.seq_len, "--batch_size", a.batch_size,
            "--max_steps", steps, "--candidate_types", ",".join(a.menu), "--output_dir", work / out,
            "--partial_save_interval", 1000]


# Linux keeps a process's RSS high-water mark across execve (exec_mmap folds the old mm's into
# signal->maxrss), so a child forked from this big process would report OUR peak as its own.
# A fresh, small Python launches the measured process and reads its rusage with os.wait4.
_LAUNCHER = ("import os, subprocess, sys\n"
             "p = subprocess.Popen(sys.argv[2:])\n"
             "_, status, ru = os.wait4(p.pid, 0)\n"
             "open(sys.argv[1], 'w').write(str(ru.ru_maxrss))\n"
             "sys.exit(os.waitstatus_to_exitcode(status))\n")


def peak_rss(args: list, log: Path) -> tuple[int, float]:
    """(ru_maxrss in bytes, wall seconds) of one CLI process (and its children), via a launcher."""
    argv = [str(Path(sys.executable).with_name("voodoo")), *map(str, args)]
    out = log.with_suffix(".maxrss")
    t0 = time.perf_counter()
    with open(log, "w") as fh:
        rc = subprocess.run([sys.executable, "-c", _LAUNCHER, str(out), *argv], stdout=fh, stderr=subprocess.STDOUT,
                            env=dict(os.environ, GGML_NO_BACKTRACE="1")).returncode
    if rc:
        raise SystemExit(f"voodoo train failed (exit {rc}); see {log}")
    return int(out.read_text()) * 1024, time.perf_counter() - t0  # Linux reports KiB


def last_step(log_jsonl: Path, n_tok: int) -> tuple[float, int]:
    """(seconds, peak RSS of the train process itself in bytes) at the last logged step: its
    tokens / its measured tokens per second, and its own getrusage(RUSAGE_SELF) peak."""
    m = json.loads(log_jsonl.read_text().splitlines()[-1])
    return n_tok / m["tokens_per_s"], int(m["memory_bytes"])


def training_step_times(hf: Path, work: Path, a: argparse.Namespace) -> list[float]:
    """Seconds of each trainer step (eager), measured inside the step (``StepMetrics``)."""
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    cfg = TrainConfig(model=str(hf), data_dir=str(work / "data"), imatrix=str(work / "imatrix.gguf"),
                      compression_ratio=0.60, seq_len=a.seq_len, batch_size=a.batch_size,
                      max_steps=a.steps + 1, candidate_types=a.menu, output_dir=str(work / "step-eager"),
                      partial_save_interval=1000)
    times: list[float] = []
    n_tok = a.seq_len * a.batch_size
    Trainer(cfg, on_step=lambda m: times.append(n_tok / m.tokens_per_s)).train()
    return times


def plain_step_times(hf: Path, work: Path, a: argparse.Namespace) -> list[float]:
    """Seconds of each plain step: float weights requiring grad, same loss, same batches."""
    import torch

    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.tools.data import load_tokens
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.losses import distill_terms

    chunk = TrainConfig(model="x", compression_ratio=0.6).loss_chunk_size  # the trainer's default
    student = load_model(hf, dtype=torch.float32)
    teacher = copy.deepcopy(student).eval()
    for p in teacher.parameters():
        p.requires_grad_(False)
    for p in student.parameters():
        p.requires_grad_(True)
    tokens = load_tokens(work / "data" / "train_tokens.pt")
    times = []
    for step in range(a.steps + 1):
        ids = tokens[step * a.batch_size:(step + 1) * a.batch_size, :a.seq_len]
        student.zero_grad(set_to_none=True)
        t0 = time.perf_counter()
        ce, kl = distill_terms(student, teacher, ids, chunk_tokens=chunk)
        (ce + kl).backward()
        times.append(time.perf_counter() - t0)
    return times


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", type=Path, default=None, help="HF checkpoint dir (default: a random Llama)")
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=49152)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--batch_size", type=int, default=1)
    ap.add_argument("--steps", type=int, default=3, help="timed steps after one warm-up step")
    ap.add_argument("--menu", nargs="+", default=list(MENU))
    ap.add_argument("--threads", type=int, default=2, help="workers/threads for the cache comparison")
    ap.add_argument("--skip_cache", action="store_true", help="skip part 1 (bench/speed_cache.py)")
    ap.add_argument("--keep", action="store_true", help="keep the work dir")
    a = ap.parse_args()
    from voodoo_quant.core import qtypes as qt

    a.menu = [qt.get(t).name for t in a.menu]

    if not a.skip_cache:
        print("== 1/3 candidate cache vs llama-quantize (bench/speed_cache.py)", flush=True)
        rc = subprocess.run([sys.executable, str(ROOT / "bench" / "speed_cache.py"), "--threads", str(a.threads)]).returncode
        if rc:
            raise SystemExit(f"bench/speed_cache.py failed (exit {rc})")

    work = Path(tempfile.mkdtemp(prefix="voodoo-bench-speed-"))
    os.environ["VOODOO_CACHE_DIR"] = str(work / "cache")  # fresh candidate cache, shared with the children
    try:
        hf = a.model or make_model(work, a)
        from voodoo_quant.model.modeling import load_config

        vocab = load_config(hf).vocab_size if a.model else a.vocab
        make_tokens(work, vocab, a.seq_len, max(8, (a.steps + 1) * a.batch_size))
        run_cli(["imatrix", "--model", hf, "--tokens", work / "data" / "train_tokens.pt", "--max_sequences", 2,
                 "--output", work / "imatrix.gguf"], work / "imatrix.log")

        print(f"\n== 2/3 training step vs plain forward+backward (seq_len {a.seq_len}, batch {a.batch_size}, "
              f"{a.steps} timed steps after 1 warm-up)", flush=True)
        t0 = time.perf_counter()
        train_t = training_step_times(hf, work, a)
        setup_s = time.perf_counter() - t0 - sum(train_t)
        plain_t = plain_step_times(hf, work, a)
        tr, pl = statistics.median(train_t[1:]), statistics.median(plain_t[1:])
        print(f"trainer step {tr:.3f} s, plain step {pl:.3f} s → trainer/plain = {tr / pl:.2f}× "
              f"(trainer setup incl. cold candidate build {setup_s:.1f} s)")

        print("\n== 3/3 peak memory of a `voodoo train --max_steps 2` process, eager vs --lazy (warm cache)", flush=True)
        res = {}
        for mode in ("eager", "lazy"):
            args = train_args(hf, work, a, 2, f"mem-{mode}") + (["--lazy"] if mode == "lazy" else [])
            rss, wall = peak_rss(args, work / f"mem-{mode}.log")
            step_s, own = last_step(work / f"mem-{mode}" / "train_log.jsonl", a.seq_len * a.batch_size)
            res[mode] = (own, rss, step_s)
            print(f"{mode:5}: peak RSS {rss / 2**20:8.1f} MiB (wait4, with its child processes; the train process "
                  f"itself by step 2: {own / 2**20:.1f} MiB), process {wall:5.1f} s, step 2 {step_s:.3f} s")
        (oe, re, se), (ol, rl, sl) = res["eager"], res["lazy"]
        print(f"eager/lazy peak RSS = {re / rl:.2f}× (train process by step 2: {oe / ol:.2f}×); "
              f"lazy/eager step time = {sl / se:.2f}×")
    finally:
        if a.keep:
            print(f"work dir kept: {work}")
        else:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
