"""The Fisher pass of a loaded model (the sensitivity table and the search's curvature): the
whole-model pass against one decoder layer at a time in place, side by side.

A random Llama (``--hidden`` 512, ``--intermediate`` 2048, ``--layers`` 8, ``--vocab`` 8192, tied
embedding) is saved once, its candidates (Q8_0, Q4_0) quantized once into a cache beside it;
then each pass runs in its own child process (the model loaded as `voodoo train` loads it,
planned, its candidates read into memory, the curvature table computed), alternating,
``--repeats`` times:

- ``whole``: ``training/fisher.fisher_diagonal`` (a float32 accumulator per weight of the model)
  and ``curvature_table`` (what a loaded model's run did until now, and does for a model the
  layer road refuses);
- ``layers``: ``training/layerwise.layerwise_curvature`` on the loaded model, in place (what a
  run now does).

Each child prints the pass's seconds (the curvature matrices included) and its peak RSS during
the pass (``VmHWM`` reset after loading, paging in every weight and reading the candidates,
through ``/proc/self/clear_refs``), beside its RSS before; the tables must be equal (the sha256
of their JSON). Threads: ``--threads`` (1) per child.

    nice -n 10 .venv/bin/python bench/eager_fisher.py [--sequences 4 --seq_len 256 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import hashlib, json, sys, time
import torch
from voodoo_quant.model.modeling import load_model
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.fisher import curvature_table, fisher_diagonal
from voodoo_quant.training.layerwise import layerwise_curvature
from voodoo_quant.training.setup import candidate_sources, plan_run, reader_weights

def status(key):
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1]) * 1024

mode, model_dir, tokens_pt = sys.argv[1], sys.argv[2], sys.argv[3]
model = load_model(model_dir, dtype=torch.float32).eval()
_, plans, _ = plan_run(TrainConfig(model=model_dir, candidate_types=("Q8_0", "Q4_0"), compression_ratio=0.6), model)
tokens = torch.load(tokens_pt, weights_only=True)
weights = reader_weights(model, plans)
sources = candidate_sources(plans, weights, {})
blobs = {p.name: dict(zip(p.menu.types, sources(p))) for p in plans}
with torch.no_grad():  # every weight paged in (a checkpoint may be mapped): `before` holds the loaded model
    sum(float(t.sum()) for t in [*model.parameters(), *model.buffers()])
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the pass's own peak
t0 = time.perf_counter()
if mode == "layers":
    curv = layerwise_curvature(model, plans, tokens, lambda p: blobs[p.name], seed=0)
else:
    curv = curvature_table(plans, weights, fisher_diagonal(model, plans, tokens, seed=0), lambda p: blobs[p.name])
sec = time.perf_counter() - t0
digest = hashlib.sha256(json.dumps(curv, sort_keys=True).encode()).hexdigest()
print("RESULT", json.dumps({"seconds": sec, "peak": status("VmHWM:"), "before": before, "table": digest}))
"""


def child(args: list[str], threads: int, cache: Path) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error", "VOODOO_CACHE_DIR": str(cache)}
    p = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not rows:
        raise SystemExit(f"child {args[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(rows[-1][len("RESULT "):])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=4)
    ap.add_argument("--seq_len", type=int, default=256)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    a = ap.parse_args()

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="voodoo-eager-fisher-") as tmp:
        t = Path(tmp)
        torch.manual_seed(0)
        cfg = LlamaConfig(vocab_size=a.vocab, hidden_size=a.hidden, intermediate_size=a.intermediate,
                          num_hidden_layers=a.layers, num_attention_heads=8, num_key_value_heads=4,
                          head_dim=a.hidden // 8, max_position_embeddings=max(128, a.seq_len),
                          tie_word_embeddings=True, initializer_range=0.05)
        LlamaForCausalLM(cfg).save_pretrained(t / "model")
        g = torch.Generator().manual_seed(1)
        torch.save(torch.randint(0, a.vocab, (a.sequences, a.seq_len), generator=g), t / "tokens.pt")
        base = [str(t / "model"), str(t / "tokens.pt")]
        modes = ("whole", "layers")
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        for r in range(a.repeats):
            for mode in modes:
                row = child([mode, *base], a.threads, t / "cache")  # the first child fills the candidate cache
                rows[mode].append(row)
                print(f"repeat {r + 1}  {mode:6}  {row['seconds']:7.2f} s  peak RSS {row['peak'] / 1e9:.3f} GB "
                      f"(before {row['before'] / 1e9:.3f} GB)  table {row['table'][:12]}", flush=True)
    same = len({x["table"] for m in modes for x in rows[m]}) == 1
    med = {m: statistics.median(x["seconds"] for x in rows[m]) for m in modes}
    peak = {m: statistics.median(x["peak"] - x["before"] for x in rows[m]) for m in modes}
    print(f"model: hidden {a.hidden}, intermediate {a.intermediate}, {a.layers} layers, vocab {a.vocab}; "
          f"{a.sequences} x {a.seq_len} tokens; {a.threads} thread(s)")
    for m in modes:
        print(f"{m:6}  median {med[m]:7.2f} s ({med[m] / med['whole']:.2f}x whole)  "
              f"peak above the loaded model (median) {peak[m] / 1e6:7.1f} MB")
    print(f"tables equal: {same}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "rows": rows,
                                     "median_seconds": med, "peak_above_model": peak, "tables_equal": same},
                                    indent=1))


if __name__ == "__main__":
    main()
