"""One `voodoo train` measured beside the memory model and a plain forward+backward.

For a model dir and a tokens dir: the dry run's predicted peak device memory (from the config
alone, :mod:`voodoo_quant.memory.plan`), then a short `voodoo train` (its per-step log gives tokens/s
and the measured peak: ``torch.cuda.max_memory_allocated`` on a GPU, peak RSS on CPU), then a
plain training step of the same HF model at the same dtype / seq_len / checkpointing (forward,
cross-entropy, backward into the weights), timed the same way. Prints one summary and writes
it as JSON. Used by bench/gpu_check.sh; runs on CPU too (``--device cpu``) for a smoke check.

    python bench/gpu_train_check.py MODEL_DIR DATA_DIR OUT --seq_len 2048 --steps 6 [--device cuda]
        [--eager] [--dtype float32] [--compensation gptq|none|auto]

Also makes its inputs: ``--make_tokens MODEL DATA N SEQ`` (random token ids),
``--make_qwen35 DIR HIDDEN LAYERS VOCAB`` and ``--make_qwen2 DIR`` (random checkpoints shaped
like the reference recipe's hybrid and like Qwen2.5-1.5B).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))


def train_flags(a) -> list[str]:
    out = ["--model", str(a.model), "--data_dir", str(a.data), "--output_dir", str(a.out / "run"),
           "--seq_len", str(a.seq_len), "--batch_size", "1", "--max_steps", str(a.steps), "--device", a.device,
           "--dtype", a.dtype, "--gradient_checkpointing", "--compression_ratio", str(a.ratio),
           "--no_warm_start", "--no_polish", "--no_resume", "--partial_save_interval", str(a.steps),
           "--error_compensation", a.compensation, "--candidate_types", *a.menu]
    if not a.eager:
        out.append("--lazy")
    if a.no_guarantee:
        out.append("--no_guarantee")
    if a.imatrix:
        out += ["--imatrix", a.imatrix]
    return out


def predict(flags: list[str]):
    from voodoo_quant.cli.tp import parse_train_flags
    from voodoo_quant.memory.dry_run import dry_run

    return dry_run(parse_train_flags(flags)).memory


def plain_step(a) -> float:
    """Seconds per plain forward+backward (the dense model, weights trainable), median of the timed steps."""
    import torch
    from transformers import AutoModelForCausalLM

    dtype = getattr(torch, a.dtype)
    dev = torch.device(a.device)
    model = AutoModelForCausalLM.from_pretrained(str(a.model), dtype=dtype).to(dev)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    vocab = model.config.get_text_config().vocab_size
    ids = torch.randint(0, vocab, (1, a.seq_len), device=dev, generator=torch.Generator(device=dev).manual_seed(0))
    times = []
    for i in range(a.plain_steps + 2):
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        out = model(input_ids=ids, labels=ids)
        out.loss.backward()
        model.zero_grad(set_to_none=True)
        if dev.type == "cuda":
            torch.cuda.synchronize(dev)
        if i >= 2:  # two warm-ups
            times.append(time.perf_counter() - t0)
    times.sort()
    return times[len(times) // 2]


def make_tokens(model: Path, data: Path, n: int, seq: int) -> None:
    """A tokens file of `n` random sequences of the model's vocabulary (speed and memory only)."""
    import torch
    from transformers import AutoConfig

    vocab = AutoConfig.from_pretrained(str(model)).get_text_config().vocab_size
    data.mkdir(parents=True, exist_ok=True)
    g = torch.Generator().manual_seed(0)
    torch.save(torch.randint(0, vocab, (n, seq), generator=g), data / "train_tokens.pt")


def make_qwen35(d: Path, hidden: int, layers: int, vocab: int) -> None:
    """A random Qwen3.5-shaped checkpoint (3 Gated DeltaNet layers per full-attention layer), bf16."""
    import torch

    from qwen35 import save_qwen35

    n = save_qwen35(d, hidden, layers, vocab, max_positions=8192, dtype=torch.bfloat16)
    print(f"Qwen3.5-shaped: {n / 1e9:.2f}e9 parameters", flush=True)


def make_qwen2(d: Path, hidden: int = 1536, intermediate: int = 8960, layers: int = 28, seed: int = 0) -> None:
    """A random checkpoint shaped like Qwen2.5-1.5B (hidden 1536, intermediate 8960, 28 layers,
    12 query / 2 key-value heads, q/k/v biases, vocabulary 151,936, untied head), bf16, built on
    the GPU when there is one (random init of 1.8e9 weights on the host is slow)."""
    import torch
    import transformers as T

    cfg = T.Qwen2Config(vocab_size=151936, hidden_size=hidden, intermediate_size=intermediate, num_hidden_layers=layers,
                        num_attention_heads=hidden // 128, num_key_value_heads=2, max_position_embeddings=32768,
                        tie_word_embeddings=False, rms_norm_eps=1e-6, rope_theta=1e6)
    torch.manual_seed(seed)
    dev = "cuda" if torch.cuda.is_available() else "cpu"
    with torch.device(dev):
        m = T.Qwen2ForCausalLM(cfg).to(torch.bfloat16)
    n = sum(p.numel() for p in m.parameters())
    m.save_pretrained(d)
    print(f"Qwen2-shaped ({hidden}/{intermediate}/{layers}): {n / 1e9:.2f}e9 parameters", flush=True)


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--make_tokens":
        make_tokens(Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--make_qwen2":
        make_qwen2(Path(sys.argv[2]), *map(int, sys.argv[3:6]))
        return
    if len(sys.argv) > 1 and sys.argv[1] == "--make_qwen35":
        make_qwen35(Path(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), int(sys.argv[5]))
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("model", type=Path)
    ap.add_argument("data", type=Path)
    ap.add_argument("out", type=Path)
    ap.add_argument("--seq_len", type=int, default=2048)
    ap.add_argument("--steps", type=int, default=6)
    ap.add_argument("--plain_steps", type=int, default=5)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--ratio", type=float, default=0.45)
    ap.add_argument("--imatrix", default=None)
    ap.add_argument("--eager", action="store_true", help="candidates dequantized once (default: --lazy)")
    ap.add_argument("--compensation", default="auto", choices=["auto", "gptq", "none"])
    ap.add_argument("--no_guarantee", action="store_true", help="leave out the references measured after the bake")
    ap.add_argument("--menu", nargs="+", default=["Q8_0", "Q5_K", "Q4_K", "IQ4_XS", "Q3_K", "Q2_K"])
    ap.add_argument("--label", default=None)
    a = ap.parse_args()
    a.out.mkdir(parents=True, exist_ok=True)
    flags = train_flags(a)
    mem = predict(flags)
    print("\n".join(mem.lines()), flush=True)
    t0 = time.perf_counter()
    p = subprocess.run([sys.executable, "-m", "voodoo_quant.cli.app", "train", *flags], cwd=ROOT,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])})
    wall = time.perf_counter() - t0
    if p.returncode != 0:
        raise SystemExit(f"voodoo train failed with status {p.returncode}")
    log = [json.loads(ln) for ln in (a.out / "run" / "train_log.jsonl").read_text().splitlines() if ln.strip()]
    steady = log[1:] or log  # the first step pays for allocations and kernel selection
    tok_s = sorted(m["tokens_per_s"] for m in steady)[len(steady) // 2]
    peak = max(m["memory_bytes"] for m in log)
    step_s = a.seq_len / tok_s
    plain = plain_step(a)
    predicted = mem.device_total if a.device.startswith("cuda") else mem.cpu_peak
    res = {"label": a.label or a.model.name, "device": a.device, "dtype": a.dtype, "seq_len": a.seq_len,
           "lazy": not a.eager, "compensation": a.compensation,
           "steps": len(log), "tokens_per_s": tok_s, "step_s": step_s, "plain_step_s": plain,
           "step_ratio": step_s / plain, "peak_memory": peak, "predicted_memory": predicted,
           "memory_error": (predicted - peak) / peak, "train_wall_s": wall}
    (a.out / "summary.json").write_text(json.dumps(res, indent=1))
    print(f"[{res['label']}] {a.device} {a.dtype} {'eager' if a.eager else 'lazy'} seq {a.seq_len}: {tok_s:,.0f} tokens/s "
          f"({step_s:.3f} s/step, plain forward+backward {plain:.3f} s: ratio {res['step_ratio']:.2f}); "
          f"peak memory {peak / 1e9:.2f} GB measured vs {predicted / 1e9:.2f} GB predicted "
          f"({res['memory_error']:+.1%}); train wall {wall:.0f} s", flush=True)


if __name__ == "__main__":
    main()
