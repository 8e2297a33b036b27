"""The real objective, measured: KL(teacher ‖ student) on calibration sequences held aside.

After the gates are baked the student is exact: every selectable tensor serves one candidate,
the very weights its GGUF bytes dequantize to. So the mean KL of the baked student on text the
gates never trained on is a measurement of the *file*, and any assignment (the gates', a stock
recipe's, a knapsack's) can be compared on it before anything is written.

``HeldAside`` runs the teacher once over the held-aside sequences and keeps what later
measurements need (its final hidden states where the LM head is a plain Linear, else its
log-probabilities), then measures any served assignment with one no-grad student forward, the
head applied in token chunks. ``probe`` runs one forward + backward with every tensor serving its
current candidate through a one-hot mixture: the gradient w.r.t. the mixture weights,
``∂KL/∂p_tj = ⟨∂KL/∂W_t, W_tj⟩``, predicts to first order what moving tensor t to any rung j
would change (``g_tj − g_tk``), for every tensor and rung at once. The search ranks its moves by it.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.nn.utils import parametrize

from .losses import chunk_reason, head_of, hidden_states
from .rungs import Rungs, serve


@dataclass(frozen=True)
class Measurement:
    """Mean KL over the held-aside predicted tokens, and per sequence (for paired comparisons)."""

    kl: float
    per_sequence: tuple[float, ...]

    @property
    def stderr(self) -> float:
        """Standard error of the mean over sequences (0 with fewer than two)."""
        n = len(self.per_sequence)
        if n < 2:
            return 0.0
        t = torch.tensor(self.per_sequence, dtype=torch.float64)
        return float(t.std(unbiased=True) / n ** 0.5)


class HeldAside:
    """KL(teacher ‖ student) on `tokens` ([n, seq]), the teacher's side computed once."""

    def __init__(self, student: nn.Module, teacher: nn.Module, tokens: torch.Tensor, *, device: torch.device,
                 teacher_device: torch.device | None = None, chunk_tokens: int = 4096, batch_size: int = 4):
        if tokens.dim() != 2 or tokens.shape[0] < 1 or tokens.shape[1] < 2:
            raise ValueError(f"held-aside tokens must be [n >= 1, seq >= 2], got {tuple(tokens.shape)}")
        self.student = student
        self.tokens = tokens
        self.device = device
        self.chunk = max(1, chunk_tokens or tokens.shape[1])
        self.batch = max(1, batch_size)
        tdev = teacher_device or device
        self._plain = chunk_reason(student) is None and chunk_reason(teacher) is None
        self._teacher: list[torch.Tensor] = []  # per batch: teacher hidden [b, seq-1, d] or log-probs
        with torch.no_grad():
            if self._plain:
                head = teacher.get_output_embeddings()
                self._t_head = (head.weight.detach(), None if head.bias is None else head.bias.detach())
            for ids in self._batches():
                ids_t = ids.to(tdev)
                if self._plain:
                    self._teacher.append(hidden_states(teacher, ids_t)[:, :-1].detach())
                else:
                    logits = teacher(input_ids=ids_t).logits[:, :-1].float()
                    self._teacher.append(F.log_softmax(logits, dim=-1))

    def _batches(self):
        for lo in range(0, self.tokens.shape[0], self.batch):
            yield self.tokens[lo: lo + self.batch]

    def _teacher_logp(self, i: int, lo: int, hi: int, seq: slice) -> torch.Tensor:
        t = self._teacher[i]
        if not self._plain:
            return t[seq].reshape(-1, t.shape[-1])[lo:hi]
        w, b = self._t_head
        h = t[seq].reshape(-1, t.shape[-1])[lo:hi]
        return F.log_softmax(F.linear(h.to(w.device), w, b).float(), dim=-1)

    def _kl_rows(self, ids: torch.Tensor, i: int) -> torch.Tensor:
        """Per-sequence KL sums of batch `i` (the student forward inside; grad if enabled)."""
        n, s1 = ids.shape[0], ids.shape[1] - 1
        sums = []
        if self._plain:
            h = hidden_states(self.student, ids)[:, :-1]
            head = head_of(self.student)
            for r in range(n):
                hr = h[r]
                acc = None
                for lo in range(0, s1, self.chunk):
                    hi = min(s1, lo + self.chunk)
                    s_log = F.log_softmax(head(hr[lo:hi]).float(), dim=-1)
                    t_log = self._teacher_logp(i, lo, hi, slice(r, r + 1)).to(s_log.device)
                    term = (t_log.exp() * (t_log - s_log)).sum()
                    acc = term if acc is None else acc + term
                sums.append(acc)
        else:
            logits = self.student(input_ids=ids).logits[:, :-1].float()
            s_log = F.log_softmax(logits, dim=-1)
            t_log = self._teacher[i].to(s_log.device)
            sums = list((t_log.exp() * (t_log - s_log)).sum(-1).sum(-1))
        return torch.stack(sums) / s1

    def measure(self) -> Measurement:
        """KL of the student as it is served now (call after serving an assignment)."""
        per = []
        with torch.no_grad(), parametrize.cached():
            for i, ids in enumerate(self._batches()):
                per.extend(float(v) for v in self._kl_rows(ids.to(self.device), i).cpu())
        return Measurement(sum(per) / len(per), tuple(per))

    def probe(self, rungs: Mapping[str, "Rungs"], current: Mapping[str, int]) -> dict[str, list[float]]:
        """∂KL/∂p for every rung of every tensor at the one-hot mixture of `current` (tensor ->
        rung index). Returns tensor -> [gradient per rung]; the served weights are unchanged."""
        probes: dict[str, torch.Tensor] = {}
        try:
            for n, r in rungs.items():
                p = torch.zeros(len(r.types), dtype=torch.float32, device=r.mq.gates.device)
                p[current[n]] = 1.0
                probes[n] = p.requires_grad_(True)
                r.mq.override = (probes[n], r.get, len(r.types))
            n_seq = self.tokens.shape[0]
            for i, ids in enumerate(self._batches()):
                with parametrize.cached():
                    (self._kl_rows(ids.to(self.device), i).sum() / n_seq).backward()
        finally:
            serve(rungs, current)
        return {n: [float(x) for x in (p.grad if p.grad is not None else torch.zeros_like(p)).cpu()]
                for n, p in probes.items()}
