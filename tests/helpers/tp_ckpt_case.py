"""One rank of the partitioned-checkpoint check (tests/test_tp_checkpoint.py), under torchrun:

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/tp_ckpt_case.py MODEL_ROOT OUT

A 2-rank --gradient_checkpointing --lazy run with a packed Q8_0 teacher: one micro-batch's (CE, KL)
and gate gradients with every decoder layer keeping 1/world of its input (tp_checkpoint.py), then
the same with HF's ordinary non-reentrant checkpoint. Each rank writes OUT/rank<r>.pt."""

from __future__ import annotations

import functools
import sys
from pathlib import Path

import torch


def main(argv: list[str]) -> None:
    import torch.distributed as dist
    from torch.utils.checkpoint import checkpoint

    from tp_case import config

    from voodoo_quant.student.layers import mixed_modules
    from voodoo_quant.distributed.tp_checkpoint import partitioned_checkpoint
    from voodoo_quant.training.teacher_q8 import is_packed
    from voodoo_quant.training.trainer import Trainer, micro_backward

    root, out = Path(argv[0]), Path(argv[1])
    torch.set_num_threads(1)
    cfg = config(root / "qwen3_5", out / "run", 2, gradient_checkpointing=True, lazy=True, teacher_quant="Q8_0",
                 warm_start=False, polish=False, loss_chunk_size=24)
    run = Trainer(cfg).prepare()
    from transformers.modeling_layers import GradientCheckpointingLayer

    layers = [m for m in run.student.modules() if isinstance(m, GradientCheckpointingLayer)
              and getattr(m, "gradient_checkpointing", False)]
    res = {"n_partitioned": sum(getattr(m._gradient_checkpointing_func, "func", None) is partitioned_checkpoint
                              for m in layers),
           "layers": len(layers), "packed_teacher": sum(is_packed(m) for m in run.teacher.modules())}
    ids = run.tokens[:2]
    for mode in ("partitioned", "plain"):
        if mode == "plain":
            for m in layers:
                m._gradient_checkpointing_func = functools.partial(checkpoint, use_reentrant=False)
        for mq in mixed_modules(run.student).values():
            mq.gates.grad = None
        ce, kl = micro_backward(run, ids, None, 1)
        res.setdefault("runs", {})[mode] = {"ce": float(ce), "kl": float(kl),
                     "grads": {n: mq.gates.grad.clone() for n, mq in mixed_modules(run.student).items()}}
    torch.save(res, out / f"rank{dist.get_rank()}.pt")
    from voodoo_quant.distributed.parallel import leave

    leave()  # meet, tear down, exit without the interpreter's teardown (gloo can abort there)


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    main(sys.argv[1:])
