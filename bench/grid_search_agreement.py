"""The torch grid search (candidates/grid_search.py) against libggml-base: how often its bytes are
libggml-base's, and what it costs beside it, on one thread.

For each matrix (Gaussian random ones, and rows of a real checkpoint's tensors) and grid type, the
same float32 matrix and imatrix vector go to libggml-base (``ggml_quantize_chunk``) and to the torch
search; printed, as Markdown, per matrix and type and summed per type:

- the fraction of 256-weight superblocks whose bytes are identical, of superblocks whose
  dequantized values are identical, and of 8-value groups whose values are identical;
- with ``--exhaustive``, the same for the torch search with the nearest entry over the whole grid
  instead of libggml-base's neighbour lists (``grid_tables.EXHAUSTIVE``): what a plain nearest-point
  search would change;
- seconds per 1e9 weights of each, and torch ÷ libggml-base: the two run alternately ``--repeats``
  times on the same matrix and the fastest run of each counts (the machine may be shared; the
  ratio is taken side by side). The first call of a type (table building) is not timed.

The imatrix vector is random positive, exp(N(0, ``--spread``)) per column (imatrix vectors of real
layers spread over orders of magnitude), seeded per matrix; or, for the real tensors with
``--imatrix_sequences N``, the layer input's mean x² per column over N × 512 tokens of the quality
benchmark's calibration text (what llama-imatrix accumulates; collected as
bench/compensation_objective.py does).

    OMP_NUM_THREADS=1 .venv/bin/python bench/grid_search_agreement.py --random 256x2048 --seeds 0,1 \\
        --hf ~/.cache/voodoo_quant/bench-models/qwen2.5-coder-1.5b-instruct/hf-degrid0-b16 \\
        --layers 1,13 --tensors q_proj,down_proj --rows 128 --exhaustive --out agreement.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
os.environ.setdefault("HF_HUB_OFFLINE", "1")

from voodoo_quant.candidates import grid_search, grid_tables  # noqa: E402
from voodoo_quant.core import ggml  # noqa: E402

TENSORS = {"q_proj": "self_attn.q_proj", "k_proj": "self_attn.k_proj", "v_proj": "self_attn.v_proj",
           "o_proj": "self_attn.o_proj", "gate_proj": "mlp.gate_proj", "up_proj": "mlp.up_proj",
           "down_proj": "mlp.down_proj"}


def real_imatrix(a) -> dict:
    """(layer, tensor) → the imatrix vector of its input from calibration text."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    sys.path.insert(0, str(ROOT / "bench"))
    import compensation_objective as co

    hf = Path(a.hf).expanduser()
    layers = [int(v) for v in a.layers.split(",")]
    # only the layers up to the deepest asked for (the rest never runs): a fraction of the memory
    model = AutoModelForCausalLM.from_pretrained(hf, dtype=torch.float32, num_hidden_layers=max(layers) + 1).eval()
    tokens = co.calibration_tokens(AutoTokenizer.from_pretrained(hf), None, a.imatrix_sequences, 512)
    stats = co.collect(model, layers, tokens, 4)
    return {(L, t): stats[(L, co.INPUT[t])][1].astype(np.float32) for L in layers for t in a.tensors.split(",")}


def matrices(a):
    """(name, W float32, imatrix vector) of every matrix asked for."""
    rng_v = lambda seed, n: np.exp(np.random.default_rng(1000 + seed).normal(0, a.spread, n)).astype(np.float32)  # noqa: E731
    for r, c in ([int(v) for v in s.split("x")] for s in (a.random.split(",") if a.random else [])):
        for seed in [int(s) for s in a.seeds.split(",")]:
            W = np.random.default_rng(seed).standard_normal((r, c)).astype(np.float32)
            yield f"gauss {r}×{c} s{seed}", W, rng_v(seed, c)
    if a.hf:
        from safetensors import safe_open

        vecs = real_imatrix(a) if a.imatrix_sequences else {}
        path = next(Path(a.hf).expanduser().glob("*.safetensors"))
        with safe_open(str(path), "np") as f:
            for L in [int(v) for v in a.layers.split(",")]:
                for t in a.tensors.split(","):
                    W = np.ascontiguousarray(f.get_slice(f"model.layers.{L}.{TENSORS[t]}.weight")[:a.rows], dtype=np.float32)
                    yield f"{L}.{t} {W.shape[0]}×{W.shape[1]}", W, vecs.get((L, t), rng_v(L, W.shape[1]))


def agreement(ref: bytes, mine: np.ndarray, q: str, shape, lib) -> dict:
    size = lib.row_size(q, 256)
    a = np.frombuffer(ref, np.uint8).reshape(-1, size)
    b = mine.reshape(-1, size)
    va = lib.dequantize(ref, q, shape).reshape(-1, 8)
    vb = lib.dequantize(mine.tobytes(), q, shape).reshape(-1, 8)
    groups = (va == vb).all(1)
    return {"superblocks": a.shape[0], "sb_bytes": int((a == b).all(1).sum()),
            "sb_values": int(groups.reshape(-1, 32).all(1).sum()), "groups": groups.size, "groups_values": int(groups.sum())}


def main(argv: list[str] | None = None) -> int:
    import torch

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--types", default=",".join(grid_search.TYPES))
    ap.add_argument("--random", default="256x2048", help="ROWSxCOLS[,...] Gaussian matrices ('' for none)")
    ap.add_argument("--seeds", default="0")
    ap.add_argument("--hf", default=None, help="a float HF checkpoint (safetensors) for real tensors")
    ap.add_argument("--layers", default="13")
    ap.add_argument("--tensors", default="q_proj,down_proj")
    ap.add_argument("--rows", type=int, default=128, help="the first ROWS rows of each real tensor")
    ap.add_argument("--imatrix_sequences", type=int, default=0, help="real tensors: the imatrix of N × 512 "
                    "calibration tokens (0: random)")
    ap.add_argument("--spread", type=float, default=1.0, help="σ of the log imatrix vector")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--exhaustive", action="store_true", help="also: the nearest entry over the whole grid")
    ap.add_argument("--out", type=Path, default=None)
    a = ap.parse_args(argv)
    torch.set_num_threads(1)
    lib = ggml.lib()
    types = a.types.split(",")
    for q in types:  # the tables of both, built once: not part of any timing
        z = np.full((1, 256), 0.01, dtype=np.float32)
        lib.quantize(z, q, np.ones(256, np.float32), workers=1)
        grid_search.quantize(torch.from_numpy(z), q, np.ones(256, np.float32))
    rows = []
    print("| matrix | type | sb bytes = | sb values = | groups values = |"
          + (" exhaustive: sb values = | groups = |" if a.exhaustive else "") + " C s/1e9 | torch s/1e9 | ÷ |")
    print("|---|---|---:|---:|---:|" + ("---:|---:|" if a.exhaustive else "") + "---:|---:|---:|")
    for name, W, v in matrices(a):
        Wt = torch.from_numpy(W)
        for q in types:
            tc, tt = [], []
            for _ in range(a.repeats):
                t0 = time.perf_counter()
                ref = lib.quantize(W, q, v, name=name, workers=1)
                t1 = time.perf_counter()
                mine = grid_search.quantize(Wt, q, v).numpy()
                t2 = time.perf_counter()
                tc.append(t1 - t0)
                tt.append(t2 - t1)
            row = {"matrix": name, "type": q, "weights": W.size, "c_s": min(tc), "torch_s": min(tt),
                   **agreement(ref, mine, q, W.shape, lib)}
            if a.exhaustive:
                grid_tables.EXHAUSTIVE = True
                try:
                    ex = agreement(ref, grid_search.quantize(Wt, q, v).numpy(), q, W.shape, lib)
                finally:
                    grid_tables.EXHAUSTIVE = False
                row.update({f"exhaustive_{k}": x for k, x in ex.items()})
            rows.append(row)
            ex_cells = (f" {row['exhaustive_sb_values'] / row['superblocks']:.4f} | "
                        f"{row['exhaustive_groups_values'] / row['groups']:.5f} |") if a.exhaustive else ""
            per = 1e9 / W.size
            print(f"| {name} | {q} | {row['sb_bytes'] / row['superblocks']:.4f} | {row['sb_values'] / row['superblocks']:.4f} | "
                  f"{row['groups_values'] / row['groups']:.5f} |{ex_cells} {row['c_s'] * per:.0f} | "
                  f"{row['torch_s'] * per:.0f} | {row['torch_s'] / row['c_s']:.2f} |", flush=True)
    summary = {}
    print("\n| type | kind | superblocks | sb bytes = | sb values = | groups values = |"
          + (" exhaustive sb values = | groups = |" if a.exhaustive else "") + " C s/1e9 | torch s/1e9 | torch ÷ C |")
    print("|---|---|---:|---:|---:|---:|" + ("---:|---:|" if a.exhaustive else "") + "---:|---:|---:|")
    for q in types:
        for kind in ("gauss", "real"):
            sel = [r for r in rows if r["type"] == q and r["matrix"].startswith("gauss") == (kind == "gauss")]
            if not sel:
                continue
            tot = lambda k: sum(r[k] for r in sel)  # noqa: E731
            n = tot("weights")
            m = {k: tot(k) for k in ("superblocks", "sb_bytes", "sb_values", "groups", "groups_values")}
            m.update(c_s_per_1e9w=tot("c_s") / n * 1e9, torch_s_per_1e9w=tot("torch_s") / n * 1e9)
            ex = ""
            if a.exhaustive:
                m.update(exhaustive_sb_values=tot("exhaustive_sb_values"), exhaustive_groups_values=tot("exhaustive_groups_values"))
                ex = f" {m['exhaustive_sb_values'] / m['superblocks']:.4f} | {m['exhaustive_groups_values'] / m['groups']:.5f} |"
            summary[f"{q} {kind}"] = m
            print(f"| {q} | {kind} | {m['superblocks']} | {m['sb_bytes'] / m['superblocks']:.5f} | "
                  f"{m['sb_values'] / m['superblocks']:.5f} | {m['groups_values'] / m['groups']:.6f} |{ex} "
                  f"{m['c_s_per_1e9w']:.0f} | {m['torch_s_per_1e9w']:.0f} | {m['torch_s_per_1e9w'] / m['c_s_per_1e9w']:.2f} |")
    if a.out:
        from voodoo_quant.core import fileio

        argv = [x.replace(str(Path.home()), "~") for x in sys.argv[1:]]
        fileio.write_text(a.out, json.dumps({"argv": argv, "rows": rows, "summary": summary}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
