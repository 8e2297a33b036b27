"""Candidate-cache build throughput vs stock llama-quantize, and 1 → 2 worker scaling.

One run, side by side, on the same tensors, types and imatrix:

- stock: ``llama-quantize --pure --imatrix`` of a tiny random Llama F32 GGUF (converted by
  llama.cpp's own converter) once per type, with ``--token-embedding-type f32`` so only the
  block tensors are quantized; its model load/write overhead is measured by an F32 → F32 copy
  run and reported separately;
- ours: :func:`voodoo_quant.candidates.precache.build_all` over the same block tensors with 1 and 2 worker
  processes (fresh caches), then a second run that finds everything cached.

Printed as ratios (and the seconds they come from). Usage:
``python bench/speed_cache.py [--hidden 512] [--types Q4_K Q6_K IQ4_XS Q8_0] [--threads 2]``
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.candidates.cache import CandidateCache  # noqa: E402
from voodoo_quant.candidates.precache import CandidateJob, build_all  # noqa: E402
from voodoo_quant.core import paths  # noqa: E402
from voodoo_quant.core import qtypes as qt  # noqa: E402
from voodoo_quant.gguf import header  # noqa: E402
from voodoo_quant.gguf.imatrix import Entry, Imatrix  # noqa: E402


def make_model(d: Path, hidden: int, layers: int) -> Path:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    from voodoo_quant.gguf.converter import convert
    from voodoo_quant.model.modeling import load_tokenizer
    from voodoo_quant.tools.embedded import smollm2_gguf_path

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=49152, hidden_size=hidden, intermediate_size=3 * hidden, num_hidden_layers=layers,
                      num_attention_heads=hidden // 64, num_key_value_heads=hidden // 128, head_dim=64,
                      tie_word_embeddings=True, bos_token_id=1, eos_token_id=2)
    hf = d / "hf"
    LlamaForCausalLM(cfg).save_pretrained(hf)
    load_tokenizer(smollm2_gguf_path()).save_pretrained(hf)
    return convert(hf, d / "model-F32.gguf", outtype="f32")


def block_tensors(gguf_path: Path) -> dict[str, np.ndarray]:
    """The 2-D F32 blk.* tensors of an F32 GGUF, as (rows, n_per_row) arrays."""
    return {
        name: np.frombuffer(data, np.float32).reshape(shape).copy()
        for name, (t, shape, data) in header.tensor_table(gguf_path).items()
        if name.startswith("blk.") and len(shape) == 2 and t == "F32"
    }


def timed(fn):
    t0 = time.perf_counter()
    res = fn()
    return time.perf_counter() - t0, res


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--types", nargs="+", default=["Q4_K", "Q6_K", "IQ4_XS", "Q8_0"])
    ap.add_argument("--threads", type=int, default=2, help="llama-quantize threads (= our max workers)")
    a = ap.parse_args()
    types = [qt.get(t).name for t in a.types]
    quantize = paths.tool_path("llama-quantize")

    work = Path(tempfile.mkdtemp(prefix="voodoo-bench-cache-"))
    try:
        model = make_model(work, a.hidden, a.layers)
        mats = block_tensors(model)
        rng = np.random.default_rng(0)
        im = Imatrix({n: Entry(rng.uniform(1, 100, m.shape[1]), [1000]) for n, m in mats.items()},
                     datasets=["bench"], chunk_count=1, chunk_size=1000)
        im_path = im.save_gguf(work / "imatrix.gguf")
        n_weights = sum(m.size for m in mats.values())
        print(f"{len(mats)} block tensors, {n_weights / 1e6:.2f} M weights, types {' '.join(types)}")

        def stock(qtype: str, threads: int) -> float:
            cmd = [quantize, "--pure", "--token-embedding-type", "f32", "--imatrix", im_path, model,
                   work / f"stock-{qtype}.gguf", qtype, str(threads)]
            t, proc = timed(lambda: subprocess.run([str(c) for c in cmd], capture_output=True, text=True))
            if proc.returncode:
                raise SystemExit(f"llama-quantize failed: {proc.stderr[-2000:]}")
            return t

        overhead = stock("F32", a.threads)
        stock_t = {t: stock(t, a.threads) for t in types}
        stock_total = sum(stock_t.values())
        stock_net = max(1e-9, stock_total - overhead * len(types))

        jobs = [CandidateJob(n, t, matrix=m, imatrix=im.vector(n, m.shape[1])) for n, m in mats.items() for t in types]
        ours = {}
        for w in sorted({1, a.threads}):
            ours[w], rep = timed(lambda w=w: build_all(jobs, CandidateCache(work / f"cache{w}"), workers=w, progress=False))
            assert rep.built == len(jobs)
        warm, rep = timed(lambda: build_all(jobs, CandidateCache(work / f"cache{a.threads}"), workers=a.threads,
                                            progress=False))
        assert rep.cached == len(jobs)

        print(f"stock llama-quantize ({a.threads} threads): {stock_total:.2f} s for {len(types)} runs "
              f"(of which model load/write ≈ {overhead:.2f} s per run, from an F32 copy run)")
        for w, t in ours.items():
            print(f"ours, {w} worker(s): {t:.2f} s  → stock/ours = {stock_total / t:.2f}×, "
                  f"stock-without-overhead/ours = {stock_net / t:.2f}×")
        if len(ours) == 2:
            print(f"scaling 1 → {a.threads} workers: {ours[1] / ours[a.threads]:.2f}× "
                  f"(includes spawning the pool: one Python + libggml start per worker)")
        print(f"second run (all cached): {warm:.2f} s → {ours[a.threads] / warm:.1f}× faster than the cold build")
        # Spot check: the cache holds stock's bytes (the tests prove it for every tensor).
        print("ok" if all(len(p.read_bytes()) for p in rep.paths.values()) else "EMPTY ENTRY")
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
