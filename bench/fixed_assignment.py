"""A finished GGUF of a quality bench, held fixed, and the validation KL of variants of its tensors.

Shared by the benches that change what a file's tensors hold without changing its assignment
(``bench/learned_values.py``, ``bench/code_descent.py``). The KL is the torch forward's
KL(teacher ‖ student) per validation sequence (training sequences no stage reads, never the eval
plays), with the planned tensors replaced by GGUF-layout float32 values, so a variant is scored
before any file is written; paired over sequences, differences of 1e-4 resolve.
"""

from __future__ import annotations

import math
import sys
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from search_transfer import rebuild_config  # noqa: E402


def mean_se(xs) -> tuple[float, float]:
    """Mean and its standard error (the project's own :func:`~voodoo_quant.tools.evaluate.stderr`)."""
    from voodoo_quant.tools.evaluate import stderr

    return math.fsum(xs) / len(xs), stderr(xs)


@dataclass
class Tensor:
    qtype: str
    data: bytes  # the file's bytes
    values: object  # torch float32 (rows, n_per_row): libggml-base's dequantization of `data`


class FixedAssignment:
    """The bench's float model (student base and teacher), plans, imatrix vectors and tokens."""

    def __init__(self, out: Path, val_start: int, val_sequences: int, batch: int = 4):
        import torch

        from voodoo_quant.training.models import load_models
        from voodoo_quant.training.setup import imatrix_vectors, load_imatrix, load_tokens, plan_run

        self.out = out
        # the bench's train config, for its model, data, imatrix and menu only: the size (80), seed
        # and run directory are placeholders, since no budget is planned and nothing is written
        self.cfg = rebuild_config(out, 80, 0, Path("/nonexistent"), Path("/tmp/fixed_assignment"), "unused.pt")
        self.base, self.teacher = load_models(self.cfg, torch.float32)
        imx = load_imatrix(self.cfg)
        _, self.plans, _ = plan_run(self.cfg, self.base, imx)
        self.vectors = imatrix_vectors(imx, self.plans)
        self.by = {p.name: p for p in self.plans}
        self.tokens = load_tokens(self.cfg.data_path, self.cfg.seq_len)
        self.val = self.tokens[val_start:val_start + val_sequences]
        self.batch = batch
        self._teacher_val = None

    def floor_path(self) -> Path:
        return next((self.out / "gguf").glob("*.stock-Q8_0.gguf"))

    def read(self, path: Path) -> dict[str, Tensor]:
        """HF name -> the file's tensor, for every planned tensor."""
        import gguf
        import numpy as np
        import torch

        from voodoo_quant.core import ggml

        lib = ggml.lib()
        tensors = {t.name: t for t in gguf.GGUFReader(path).tensors}
        out = {}
        for p in self.plans:
            t = tensors[p.gguf_name]
            data = bytes(t.data.tobytes())
            m = lib.dequantize(data, t.tensor_type.name, (p.rows, p.n_per_row), name=p.name)
            out[p.name] = Tensor(t.tensor_type.name, data, torch.from_numpy(np.ascontiguousarray(m)))
        return out

    def float_matrix(self, name: str):
        """The float model's weight `name` in GGUF layout (numpy float32)."""
        return self.by[name].layout.to_gguf(dict(self.base.named_parameters())[name])

    def teacher_logp(self, x):
        import torch
        import torch.nn.functional as F

        with torch.no_grad():
            return F.log_softmax(self.teacher(x).logits.float(), -1)

    def kl(self, weights: dict, x, teacher_logp):
        """Per-sequence mean KL(teacher ‖ student), the planned tensors set to `weights` (GGUF layout)."""
        import torch
        import torch.nn.functional as F

        hf = {n: self.by[n].layout.from_gguf(w) for n, w in weights.items()}
        out = torch.func.functional_call(self.base, hf, (x,), tie_weights=True, strict=False)
        slp = F.log_softmax(out.logits.float(), -1)
        return (teacher_logp.exp() * (teacher_logp - slp)).sum(-1).mean(-1)

    def val_kl(self, weights: dict) -> list[float]:
        """Per validation sequence KL of the student with `weights` (teacher log-probs computed once)."""
        import torch

        starts = range(0, self.val.shape[0], self.batch)
        if self._teacher_val is None:
            self._teacher_val = [self.teacher_logp(self.val[i:i + self.batch]) for i in starts]
        per = []
        with torch.no_grad():
            for k, i in enumerate(starts):
                per += self.kl(weights, self.val[i:i + self.batch], self._teacher_val[k]).tolist()
        return per
