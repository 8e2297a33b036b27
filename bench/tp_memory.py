"""Host peak RSS per rank of a 2-rank gloo tensor-parallel run: sharded vs whole-model loading.

A random Qwen3.5-shaped checkpoint (hidden 2048 by default) is saved with ``save_pretrained``;
two torchrun ranks then prepare a ``--lazy`` run and train one step, once with sharded loading
(skeleton + sliced reads, the default under TP) and once with the whole-model path every rank
took before (load the float32 model, deep-copy the teacher, split both), forced by disabling
``training.models.can_load_sharded`` in the ranks. Each rank reports ``ru_maxrss`` after
``prepare()`` (loading, candidates, split) and after the step (on CPU the training state lives in
the same RAM). Printed per rank, with the sharded / whole ratio.

With ``--sensitivity`` both runs load sharded and keep the warm start and polish on (the
defaults, so rank 0 computes the Fisher sensitivity table): once streaming it one decoder layer at
a time (training/layerwise.py, the default) and once on the float32 model loaded whole on rank 0,
the path before it, forced by replacing ``trainer.sensitivity_model``.

    python bench/tp_memory.py [--hidden 2048] [--layers 8] [--vocab 32768] [--out bench/results/tp_memory.json]
    python bench/tp_memory.py --sensitivity --out bench/results/tp_memory_sensitivity.json
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))
MENU = ("Q8_0", "Q4_K", "Q2_K")


def make_model(d: Path, hidden: int, layers: int, vocab: int, seq: int) -> int:
    from qwen35 import save_qwen35, save_tokens

    n = save_qwen35(d / "model", hidden, layers, vocab, max_positions=4 * seq)
    save_tokens(d / "data", vocab, 4, seq)
    return n


def rank_main(d: Path, out: Path, mode: str, seq: int, dtype: str) -> None:
    """One torchrun rank: prepare, record the peak, one step, record again."""
    import torch
    import torch.distributed as dist

    from voodoo_quant.training import models
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    torch.set_num_threads(1)
    if mode == "whole":
        models.can_load_sharded = lambda cfg: False  # the whole-model path every rank took before
    if mode == "loaded":  # the sensitivity pass on the float32 model loaded whole on rank 0 (before layerwise.py)
        from voodoo_quant.training import trainer

        def loaded(cfg, base, tp=None):
            if tp is not None and not tp.is_main:
                return base
            from voodoo_quant.model.modeling import load_model

            return load_model(cfg.model, dtype=torch.float32)
        trainer.sensitivity_model = loaded
    warm = mode in ("layerwise", "loaded")
    cfg = TrainConfig(model=str(d / "model"), data_dir=str(d / "data"), seq_len=seq, batch_size=1, max_steps=1,
                      compression_ratio=0.6, candidate_types=MENU, output_dir=str(out / mode), tensor_parallel=2,
                      lazy=True, warm_start=warm, polish=warm, guarantee=False, dtype=dtype, loss_chunk_size=64)
    tr = Trainer(cfg)
    tr.prepare()
    after_prepare = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    tr.train()
    after_step = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    rank = dist.get_rank()
    (out / f"{mode}-rank{rank}.json").write_text(json.dumps({"prepare": after_prepare, "step": after_step}))
    from voodoo_quant.distributed.parallel import leave

    leave()  # meet, tear down, exit without the interpreter's teardown (gloo can abort there)


def run(d: Path, out: Path, mode: str, seq: int, dtype: str) -> list[dict]:
    env = {**os.environ, "PYTHONPATH": str(ROOT), "VOODOO_QUANT_WORKERS": "1", "OMP_NUM_THREADS": "1"}
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2",
                        str(Path(__file__).resolve()), "--rank", str(d), str(out), mode, str(seq), dtype],
                       capture_output=True, text=True, env=env, cwd=ROOT)
    if p.returncode != 0:
        raise SystemExit(f"{mode} run failed:\n{p.stderr[-4000:]}")
    return [json.loads((out / f"{mode}-rank{r}.json").read_text()) for r in range(2)]


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--rank":
        d, out, mode, seq, dtype = sys.argv[2:7]
        rank_main(Path(d), Path(out), mode, int(seq), dtype)
        return
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--hidden", type=int, default=2048)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--vocab", type=int, default=32768)
    ap.add_argument("--seq_len", type=int, default=64)
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--workdir", type=Path, default=None)
    ap.add_argument("--out", type=Path, default=None)
    ap.add_argument("--sensitivity", action="store_true", help="warm start on: the streamed sensitivity pass vs the loaded one")
    a = ap.parse_args()
    modes = ("layerwise", "loaded") if a.sensitivity else ("sharded", "whole")
    with tempfile.TemporaryDirectory(prefix="voodoo-tpmem-") as tmp:
        work = a.workdir or Path(tmp)
        d = work / "model-dir"
        n = make_model(d, a.hidden, a.layers, a.vocab, a.seq_len) if not (d / "model").is_dir() else None
        res = {"hidden": a.hidden, "layers": a.layers, "vocab": a.vocab, "params": n, "dtype": a.dtype}
        out = work / "runs"
        out.mkdir(parents=True, exist_ok=True)
        for mode in modes:
            res[mode] = run(d, out, mode, a.seq_len, a.dtype)
        print(f"Qwen3.5-shaped, hidden {a.hidden}, {a.layers} layers, vocab {a.vocab}"
              + (f", {n / 1e9:.2f}e9 parameters" if n else "") + f", 2 gloo ranks, --lazy, {a.dtype}")
        for phase in ("prepare", "step"):
            for r in range(2):
                s, w = res[modes[0]][r][phase], res[modes[1]][r][phase]
                print(f"  rank {r} peak RSS after {phase:7}: {modes[0]} {s / 1e9:6.2f} GB  {modes[1]} {w / 1e9:6.2f} GB  "
                      f"ratio {s / w:.2f}")
        if a.out:
            a.out.parent.mkdir(parents=True, exist_ok=True)
            a.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
