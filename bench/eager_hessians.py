"""The Hessians of error compensation on a loaded model: the whole-model collection in passes
against one forward, one decoder layer at a time, side by side.

A random Llama (``--hidden`` 512, ``--intermediate`` 2048, ``--layers`` 8, tied embedding) is saved
once; then each collection runs in its own child process (the model loaded as `voodoo train`
loads it, planned, the Hessians collected and written to a file), alternating, ``--repeats``
times:

- ``passes``: ``training/hessians.collect_passes`` with its pass size set so that it takes
  ``--passes`` (3) forwards over the text, as the 4 GB default does at 1.5B;
- ``one-pass``: the same in one forward (every accumulator held at once);
- ``layers``: ``training/layer_hessians.collect_layerwise`` on the loaded model, in place (what a
  run now does).

Each child prints the collection's seconds (the file written included) and its peak RSS during
the collection (``VmHWM`` reset after loading and paging in every weight, through
``/proc/self/clear_refs``), beside its RSS before; the three files must be the same bytes. Threads: ``--threads`` (1) per child.

    nice -n 10 .venv/bin/python bench/eager_hessians.py [--sequences 16 --seq_len 128 --repeats 2]

``--products``: instead, the accumulation itself on one thread, for x of ``--rows`` (2048) × n, n
in ``--widths`` (1536 8960): the full product added to an n × n sum (``acc.add_(x.T @ x)``, what
the hooks did before) against the upper block triangle the hooks add now
(training/hessians.py ``add_gram_upper``), alternating, ``--repeats`` times each after a warm-up,
with the mirror (``mirror_upper``, once per finished Hessian) timed apart. Printed per n: the
blocks, the flops ratio (B+1)/(2B) and the median triangle ÷ full ratio of CPU seconds (the
thread's; other jobs on the cores stretch wall time, not these) and of wall seconds.

    OMP_NUM_THREADS=1 nice -n 10 .venv/bin/python bench/eager_hessians.py --products [--repeats 5]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

_CHILD = """
import json, sys, time
import torch
from voodoo_quant.candidates.hessian_store import write_hessians
from voodoo_quant.model.modeling import load_model
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.hessians import collect_passes
from voodoo_quant.training.layer_hessians import collect_layerwise
from voodoo_quant.training.setup import plan_run

def status(key):
    return int(next(ln for ln in open("/proc/self/status") if ln.startswith(key)).split()[1]) * 1024

mode, model_dir, tokens_pt, out, pass_bytes = sys.argv[1], sys.argv[2], sys.argv[3], sys.argv[4], int(sys.argv[5])
model = load_model(model_dir, dtype=torch.float32).eval()
_, plans, _ = plan_run(TrainConfig(model=model_dir, candidate_types=("Q8_0", "Q4_0"), compression_ratio=0.6), model)
tokens = torch.load(tokens_pt, weights_only=True)
with torch.no_grad():  # every weight paged in (a checkpoint may be mapped): `before` holds the loaded model
    sum(float(t.sum()) for t in [*model.parameters(), *model.buffers()])
before = status("VmRSS:")
open("/proc/self/clear_refs", "w").write("5")  # VmHWM from here: the collection's own peak
t0 = time.perf_counter()
if mode == "layers":
    c = collect_layerwise(model, plans, tokens)
else:
    c = collect_passes(model, plans, tokens, pass_bytes=pass_bytes)
write_hessians(out, c.sizes, c.shared, "bench", c.arrays)
sec = time.perf_counter() - t0
print("RESULT", json.dumps({"seconds": sec, "peak": status("VmHWM:"), "before": before, "passes": c.passes}))
"""


def child(args: list[str], threads: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads),
           "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    p = subprocess.run([sys.executable, "-c", _CHILD, *args], capture_output=True, text=True, env=env, cwd=ROOT)
    rows = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
    if p.returncode != 0 or not rows:
        raise SystemExit(f"child {args[0]} failed ({p.returncode}):\n{p.stderr[-3000:]}")
    return json.loads(rows[-1][len("RESULT "):])


def _passes(widths: list[int], budget: int) -> int:
    n, held = 0, 0
    for w in widths:
        if n == 0 or held + 4 * w * w > budget:
            n, held = n + 1, 0
        held += 4 * w * w
    return n


def products(a) -> dict:
    """The --products comparison (module docstring): per width, the seconds of each side and the
    median ratios."""
    import time

    import torch

    from voodoo_quant.training.hessians import add_gram_upper, gram_edges, gram_flops, mirror_upper

    torch.set_num_threads(1)

    def timed(f) -> tuple[float, float]:
        w, c = time.perf_counter(), time.thread_time()
        f()
        return time.thread_time() - c, time.perf_counter() - w

    out: dict = {}
    for n in a.widths:
        x = torch.randn(a.rows, n, generator=torch.Generator().manual_seed(n))
        acc = torch.zeros(n, n)
        full = lambda: acc.add_(x.T @ x)  # noqa: E731
        tri = lambda: add_gram_upper(acc, x)  # noqa: E731
        full(), tri()  # warm-up
        rows: dict[str, list] = {"full": [], "triangle": []}
        for r in range(a.repeats):
            for name, f in (("full", full), ("triangle", tri)) if r % 2 == 0 else (("triangle", tri), ("full", full)):
                rows[name].append(timed(f))
        mirror = statistics.median(timed(lambda: mirror_upper(acc))[0] for _ in range(3))
        blocks = len(gram_edges(n)) - 1
        cpu = statistics.median(t[0] / f[0] for t, f in zip(rows["triangle"], rows["full"]))
        wall = statistics.median(t[1] / f[1] for t, f in zip(rows["triangle"], rows["full"]))
        flops = gram_flops(a.rows, n) / (2.0 * a.rows * n * n)
        out[n] = {"blocks": blocks, "flops_ratio": flops, "cpu_ratio": cpu, "wall_ratio": wall, "mirror_cpu_s": mirror,
                  "full": rows["full"], "triangle": rows["triangle"]}
        f_cpu = statistics.median(f[0] for f in rows["full"])
        print(f"n {n:5d}  {blocks} block(s)  flops {flops:.3f}x  full {f_cpu:7.3f} CPU s "
              f"({2.0 * a.rows * n * n / f_cpu / 1e9:.1f} GFLOP/s)  triangle/full: CPU {cpu:.3f}x, wall {wall:.3f}x "
              f"(median of {a.repeats}); mirror {mirror:.3f} CPU s once per Hessian", flush=True)
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--sequences", type=int, default=16)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--passes", type=int, default=3, help="forwards the multi-pass collection is made to take")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path, default=None, help="write the rows as JSON here")
    ap.add_argument("--products", action="store_true", help="time the accumulation alone (module docstring)")
    ap.add_argument("--rows", type=int, default=2048, help="--products: tokens per batch")
    ap.add_argument("--widths", type=int, nargs="+", default=[1536, 8960], help="--products: input widths")
    a = ap.parse_args()
    if a.products:
        res = products(a)
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "widths": res}, indent=1))
        return

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    with tempfile.TemporaryDirectory(prefix="voodoo-eager-hessians-") as tmp:
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
        # the smallest pass size (in steps of the narrowest input) that takes --passes forwards, grouped as
        # collect_passes groups the inputs: in order, a new pass when the next would not fit
        inputs = [w for _ in range(a.layers) for w in (a.hidden, a.hidden, a.hidden, a.intermediate)] + [a.hidden]
        pass_bytes = max(inputs) ** 2 * 4
        while _passes(inputs, pass_bytes) > a.passes:
            pass_bytes += 4 * min(inputs) ** 2
        modes = {"passes": pass_bytes, "one-pass": 1 << 62, "layers": 0}
        rows: dict[str, list[dict]] = {m: [] for m in modes}
        digests: dict[str, set[str]] = {m: set() for m in modes}
        for r in range(a.repeats):
            for mode, pb in modes.items():
                out = t / f"{mode}.safetensors"
                row = child([mode, *base, str(out), str(pb)], a.threads)
                digests[mode].add(hashlib.sha256(out.read_bytes()).hexdigest())
                rows[mode].append(row)
                if mode == "passes" and row["passes"] != a.passes:
                    raise SystemExit(f"the multi-pass collection took {row['passes']} forwards, not {a.passes}")
                print(f"repeat {r + 1}  {mode:8}  {row['passes']} forward(s)  {row['seconds']:7.2f} s  "
                      f"peak RSS {row['peak'] / 1e9:.3f} GB (before {row['before'] / 1e9:.3f} GB)", flush=True)
    same = len(set().union(*digests.values())) == 1
    med = {m: statistics.median(x["seconds"] for x in rows[m]) for m in modes}
    peak = {m: statistics.median(x["peak"] - x["before"] for x in rows[m]) for m in modes}
    print(f"model: hidden {a.hidden}, intermediate {a.intermediate}, {a.layers} layers, vocab {a.vocab}; "
          f"{a.sequences} x {a.seq_len} tokens; {a.threads} thread(s); pass size {pass_bytes / 2 ** 20:.0f} MiB")
    for m in modes:
        print(f"{m:8}  median {med[m]:7.2f} s ({med[m] / med['passes']:.2f}x passes)  "
              f"peak above the loaded model (median) {peak[m] / 1e6:7.1f} MB")
    print(f"Hessians files equal: {same}")
    if a.out:
        a.out.parent.mkdir(parents=True, exist_ok=True)
        a.out.write_text(json.dumps({"args": {k: str(v) for k, v in vars(a).items()}, "pass_bytes": pass_bytes,
                                     "rows": rows, "median_seconds": med, "peak_above_model": peak,
                                     "files_equal": same}, indent=1))


if __name__ == "__main__":
    main()
