"""Paired A/B of the trainer step, alternating order: a tied gate set mixed once (layers.cached()) vs once per module (parametrize.cached() alone).

    .venv/bin/python bench/tied_mix_ab.py runs/demo/work/hf/SmolLM2-135M-Instruct runs/demo/imatrix.gguf runs/demo/work/data/train_tokens.pt 16
"""
import copy, os, statistics, sys, tempfile, time
from pathlib import Path
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
from voodoo_quant.hardware.envdefaults import apply_env_defaults, host_env_defaults
apply_env_defaults(host_env_defaults(), os.environ)
import torch
from torch.nn.utils import parametrize
from voodoo_quant import layers as L
from voodoo_quant.modeling import load_model
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.losses import distill_terms
from voodoo_quant.training.trainer import Trainer
from voodoo_quant.training.schedule import batch_indices
MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_XS", "IQ4_NL", "Q3_K", "IQ3_S", "IQ2_S")
model, imatrix, tokens, reps = Path(sys.argv[1]), Path(sys.argv[2]), Path(sys.argv[3]), int(sys.argv[4])
work = Path(tempfile.mkdtemp(prefix="ab-"))
cfg = TrainConfig(model=str(model), data_dir=str(tokens.parent), data_name=tokens.name, imatrix=str(imatrix),
                  compression_ratio=0.65, seq_len=256, batch_size=1, max_steps=1000, candidate_types=MENU,
                  output_dir=str(work / "run"), warm_start=False, polish=False)
tr = Trainer(cfg); run = tr.prepare()
opt = torch.optim.Adam([m.gates for m in run.mixed.values()], lr=cfg.lr)
plain = load_model(model, dtype=torch.float32); pt = copy.deepcopy(plain).eval()
for p in pt.parameters(): p.requires_grad_(False)
def ids_at(s): return run.tokens[batch_indices(s, 1, run.tokens.shape[0], cfg.seed)]
NEW = L.cached
def once(s): tr._step(run, opt, s)
def per_module(s):
    L.cached = parametrize.cached
    try: tr._step(run, opt, s)
    finally: L.cached = NEW
def plain_step(s):
    plain.zero_grad(set_to_none=True); ce, kl = distill_terms(plain, pt, ids_at(s), chunk_tokens=cfg.loss_chunk_size); (ce + kl).backward()
fs = {"once": once, "per module": per_module, "plain": plain_step}
ts = {k: [] for k in fs}
for s in range(reps + 1):
    order = list(fs) if s % 2 == 0 else [list(fs)[1], list(fs)[0], list(fs)[2]]
    for k in order:
        t0 = time.perf_counter(); fs[k](s); v = time.perf_counter() - t0
        if s: ts[k].append(v)
for k, v in ts.items():
    print(f"{k:11} median {statistics.median(v):.3f} s  / plain {statistics.median(a / b for a, b in zip(v, ts['plain'])):.3f}  all {' '.join(f'{x:.2f}' for x in v)}")
d = [a - b for a, b in zip(ts["per module"], ts["once"])]
print(f"per module - once: median {statistics.median(d):+.3f} s, mean {statistics.mean(d):+.3f} ± {statistics.stdev(d) / len(d) ** 0.5:.3f} (s.e.), n={len(d)}")
