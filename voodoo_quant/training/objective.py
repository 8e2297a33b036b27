"""The real objective, measured: KL(teacher ‖ student) on calibration sequences held aside.

After the gates are baked the student is exact: every selectable tensor serves one candidate,
the very weights its GGUF bytes dequantize to. So the mean KL of the baked student on text the
gates never trained on is a measurement of the *file*, and any assignment (the gates', a stock
recipe's, a knapsack's) can be compared on it before anything is written.

``HeldAside`` runs the teacher once over the held-aside sequences and keeps what later
measurements need (its final hidden states where the LM head is a plain Linear, else its
log-probabilities), then measures any served assignment with one no-grad student forward, the
head applied in token chunks. ``probe`` runs one forward + backward of the served assignment: the
gradient G_t w.r.t. each served weight predicts to first order what moving tensor t from rung k to
a neighbouring rung j would change, ``⟨G_t, W_tj − W_tk⟩`` (the derivative of the one-hot mixture
``Σ p_j W_tj`` in the direction of rung j), for every tensor at once. The search ranks its moves by it.

Two exact shortcuts keep a search's many measurements cheap: the teacher's log-probabilities are
kept when they fit in ``TEACHER_CACHE_BYTES`` (else its head is re-applied to its cached hidden
states), and every decoder layer's output under the *committed* assignment is kept (when it fits
in ``PREFIX_CACHE_BYTES``): a move that changes only tensors of layer L and later replays layers
0..L−1 from that cache (``measure(from_layer=L)``) and recomputes the rest; ``commit()`` adopts
the last measurement's outputs when its move is kept.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Mapping

import torch
import torch.nn as nn
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from ..model.lm_head import chunk_reason
from .losses import head_of, hidden_states
from .rungs import RungSource, Rungs, serve
from .tp_losses import teacher_hidden_states, tp_distill_terms


TEACHER_CACHE_BYTES = 1 << 30
PREFIX_CACHE_BYTES = 2 << 30
_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)\.")


def layer_of(name: str) -> int | None:
    """Decoder-layer index of an HF parameter name (``model.layers.7.mlp.up_proj.weight`` -> 7),
    None for a tensor outside the layers (embedding, head)."""
    m = _LAYER.search(name)
    return None if m is None else int(m.group(1))


class _Tap(nn.Module):
    """A decoder layer that can replay a stored output instead of running, or record its output."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.replay: object | None = None
        self.record: list | None = None

    def forward(self, *args, **kwargs):
        if self.replay is not None:
            return self.replay
        out = self.inner(*args, **kwargs)
        if self.record is not None:
            self.record.append(out.detach() if isinstance(out, torch.Tensor) else out)
        return out

    def __getattr__(self, name: str):
        try:
            return super().__getattr__(name)
        except AttributeError:
            return getattr(self._modules["inner"], name)


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
        self._prepare_teacher(teacher, teacher_device or device)
        self._layers = _decoder_layers(student)
        hidden = getattr(getattr(student, "config", None), "hidden_size", None)
        fits = (self._layers is not None and hidden is not None
                and len(self._layers) * tokens.numel() * hidden * 4 <= PREFIX_CACHE_BYTES)
        self._prefix_ok = fits
        self._committed: list[list] | None = None  # [batch][layer] outputs of the committed assignment
        self._pending: tuple[int, list[list]] | None = None

    def _prepare_teacher(self, teacher: nn.Module, tdev: torch.device) -> None:
        """The teacher's side of every measurement, computed once."""
        student, tokens = self.student, self.tokens
        self._plain = chunk_reason(student) is None and chunk_reason(teacher) is None
        self._teacher: list[torch.Tensor] = []  # per batch: teacher hidden [b, seq-1, d] or log-probs
        vocab = teacher.get_output_embeddings().weight.shape[0] if teacher.get_output_embeddings() is not None else 0
        n_pred = tokens.shape[0] * (tokens.shape[1] - 1)
        self._logp = not self._plain or n_pred * vocab * 4 <= TEACHER_CACHE_BYTES
        with torch.no_grad():
            if self._plain:
                head = teacher.get_output_embeddings()
                self._t_head = (head.weight.detach(), None if head.bias is None else head.bias.detach())
            for ids in self._batches():
                ids_t = ids.to(tdev)
                if self._plain and not self._logp:
                    self._teacher.append(hidden_states(teacher, ids_t)[:, :-1].detach())
                elif self._plain:
                    h = hidden_states(teacher, ids_t)[:, :-1]
                    w, b = self._t_head
                    self._teacher.append(F.log_softmax(F.linear(h.to(w.device), w, b).float(), dim=-1))
                else:
                    logits = teacher(input_ids=ids_t).logits[:, :-1].float()
                    self._teacher.append(F.log_softmax(logits, dim=-1))

    def _batches(self):
        for lo in range(0, self.tokens.shape[0], self.batch):
            yield self.tokens[lo: lo + self.batch]

    def _teacher_logp(self, i: int, lo: int, hi: int, seq: slice) -> torch.Tensor:
        t = self._teacher[i]
        if self._logp:
            return t[seq].reshape(-1, t.shape[-1])[lo:hi]
        w, b = self._t_head
        h = t[seq].reshape(-1, t.shape[-1])[lo:hi]
        return F.log_softmax(F.linear(h.to(w.device), w, b).float(), dim=-1)

    def _kl_rows(self, ids: torch.Tensor, i: int, row0: int = 0) -> torch.Tensor:
        """Per-sequence KL sums of `ids`, rows `row0`.. of batch `i` (the student forward inside;
        grad if enabled, each head chunk then checkpointed: its logits and the teacher's are
        recomputed in backward, so one chunk's are alive at a time, as in the training loss)."""
        n, s1 = ids.shape[0], ids.shape[1] - 1
        sums = []
        if self._plain:
            h = hidden_states(self.student, ids)[:, :-1]
            head = head_of(self.student)
            grad = torch.is_grad_enabled()
            for r in range(n):
                hr = h[r]
                acc = None
                for lo in range(0, s1, self.chunk):
                    hi = min(s1, lo + self.chunk)
                    def chunk(hs, lo=lo, hi=hi, row=slice(row0 + r, row0 + r + 1)):
                        return _kl_chunk(head, hs, self._teacher_logp(i, lo, hi, row))
                    term = checkpoint(chunk, hr[lo:hi], use_reentrant=False) if grad else chunk(hr[lo:hi])
                    acc = term if acc is None else acc + term
                sums.append(acc)
        else:
            logits = self.student(input_ids=ids).logits[:, :-1].float()
            s_log = F.log_softmax(logits, dim=-1)
            t_log = self._teacher[i][row0:row0 + n].to(s_log.device)
            sums = list((t_log.exp() * (t_log - s_log)).sum(-1).sum(-1))
        return torch.stack(sums) / s1

    def measure(self, from_layer: int = 0) -> Measurement:
        """KL of the student as it is served now (call after serving an assignment). With
        `from_layer` L > 0, layers 0..L−1 replay the committed assignment's outputs: exact when
        the served assignment differs from the committed one only in layers >= L."""
        per = []
        prefix = self._prefix_ok and (from_layer == 0 or self._committed is not None)
        start = from_layer if prefix and self._committed is not None else 0
        taps = self._install() if prefix else None
        outs: list[list] = []
        try:
            with torch.no_grad():  # no parametrize.cached(): a served rung is produced per use (rungs.py)
                for i, ids in enumerate(self._batches()):
                    rec: list = []
                    if taps is not None:
                        for j, tap in enumerate(taps):
                            tap.replay = self._committed[i][j] if j < start else None
                            tap.record = rec if j >= start else None
                    per.extend(float(v) for v in self._kl_rows(ids.to(self.device), i).cpu())
                    outs.append(rec)
        finally:
            if taps is not None:
                self._remove(taps)
        self._pending = (start, outs) if taps is not None else None
        return Measurement(sum(per) / len(per), tuple(per))

    def commit(self) -> None:
        """Adopt the last measurement's layer outputs as the committed assignment's."""
        if self._pending is None:
            self._committed = None
            return
        start, outs = self._pending
        if start == 0:
            self._committed = outs
        elif self._committed is not None:
            for i, rec in enumerate(outs):
                self._committed[i][start:] = rec
        self._pending = None

    def _install(self) -> list[_Tap]:
        taps = [_Tap(layer) for layer in self._layers]
        for j, t in enumerate(taps):
            self._layers[j] = t
        return taps

    def _remove(self, taps: list[_Tap]) -> None:
        for j, t in enumerate(taps):
            self._layers[j] = t.inner

    def probe(self, rungs: Mapping[str, "Rungs"], current: Mapping[str, int]) -> dict[str, list[float]]:
        """First-order ΔKL of moving each tensor one rung: ``⟨∂KL/∂W_t, W_tj − W_tk⟩`` for the
        neighbours j = k ± 1 of its current rung k (0 at k, NaN for rungs further away), from one
        forward + backward of the served assignment, a sequence at a time. Each tensor serves the
        one-hot mixture of its rungs k − 1, k, k + 1 (exactly W_tk), whose float64 gate gradient
        is ``⟨∂KL/∂W_t, W_tj⟩`` (``layers._Mix``, float64 dot products: the two inner products a
        difference comes from are nearly equal). No weight or weight gradient outlives its layer's
        use: a lazy rung is dequantized when used, as in a training step."""
        gates: dict[str, tuple[torch.Tensor, list[int]]] = {}
        try:
            for n, r in rungs.items():
                k = current[n]
                js = [j for j in (k - 1, k, k + 1) if 0 <= j < len(r.types)]
                p = torch.zeros(len(js), dtype=torch.float64, device=r.mq.gates.device)
                p[js.index(k)] = 1.0
                gates[n] = (p.requires_grad_(True), js)
                r.mq.override = (p, RungSource(r, js), len(js))
            n_seq = self.tokens.shape[0]
            self._pending = None
            for i, ids in enumerate(self._batches()):
                for row in range(ids.shape[0]):  # one sequence at a time: what autograd keeps is a batch of 1
                    (self._kl_rows(ids[row:row + 1].to(self.device), i, row).sum() / n_seq).backward()
            out: dict[str, list[float]] = {}
            for n, r in rungs.items():
                k = current[n]
                p, js = gates[n]
                g = p.grad
                row = [float("nan")] * len(r.types)
                for pos, j in enumerate(js):
                    row[j] = 0.0 if g is None else float(g[pos] - g[js.index(k)])
                out[n] = row
            return self._combine(out)
        finally:
            serve(rungs, current)

    def _combine(self, rows: dict[str, list[float]]) -> dict[str, list[float]]:
        """The probe's rows as every process agrees on them (one process: as they are)."""
        return rows


class TPHeldAside(HeldAside):
    """:class:`HeldAside` under tensor parallelism: each sequence through the vocabulary-sharded
    loss (``tp_losses.tp_distill_terms``), so every rank gets the same per-sequence KL, the mean of
    them as :class:`HeldAside` measures it (up to float summation order). The teacher's final
    hidden states are kept when they fit in ``TEACHER_CACHE_BYTES`` (its sharded head is
    re-applied to them), and the prefix replay works as in one process: a decoder layer's output
    is the whole hidden state on every rank, and every rank skips the same layers, so their
    collectives stay matched. ``probe`` sums each split tensor's inner products over the ranks
    (`sharded`: the gated tensors split across them); a replicated tensor's, equal on every rank,
    are rank 0's. Every rank thus measures, probes and decides alike, and the search runs on all."""

    def __init__(self, student: nn.Module, teacher: nn.Module, tokens: torch.Tensor, tp, *, device: torch.device,
                 teacher_device: torch.device | None = None, chunk_tokens: int = 0,
                 sharded: frozenset[str] | set[str] = frozenset()):
        self.tp, self.sharded = tp, frozenset(sharded)
        super().__init__(student, teacher, tokens, device=device, teacher_device=teacher_device,
                         chunk_tokens=chunk_tokens, batch_size=1)

    def _prepare_teacher(self, teacher: nn.Module, tdev: torch.device) -> None:
        self.teacher, self.teacher_device = teacher, tdev
        hidden = teacher.get_output_embeddings().weight.shape[-1]
        n_pred = self.tokens.shape[0] * (self.tokens.shape[1] - 1)
        self._teacher = []  # per sequence: the teacher's final hidden states, or none kept
        if n_pred * hidden * 4 <= TEACHER_CACHE_BYTES:
            self._teacher = [teacher_hidden_states(teacher, ids.to(tdev)) for ids in self._batches()]

    def _kl_rows(self, ids: torch.Tensor, i: int, row0: int = 0) -> torch.Tensor:
        _ce, kl = tp_distill_terms(self.student, self.teacher, ids, self.tp, chunk_tokens=self.chunk,
                                   teacher_device=self.teacher_device,
                                   teacher_hidden=self._teacher[i] if self._teacher else None)
        return kl.reshape(1)

    def _combine(self, rows: dict[str, list[float]]) -> dict[str, list[float]]:
        names = sorted(rows)
        mine = [v if n in self.sharded or self.tp.is_main else 0.0 for n in names for v in rows[n]]
        flat = self.tp.all_reduce(torch.tensor(mine, dtype=torch.float64))
        out, off = {}, 0
        for n in names:
            k = len(rows[n])
            out[n] = [float(v) for v in flat[off:off + k]]
            off += k
        return out


def _kl_chunk(head: nn.Module, h: torch.Tensor, t_log: torch.Tensor) -> torch.Tensor:
    """Σ over a chunk of positions of KL(teacher ‖ student), from the student's hidden states."""
    s_log = F.log_softmax(head(h).float(), dim=-1)
    t_log = t_log.to(s_log.device)
    return (t_log.exp() * (t_log - s_log)).sum()


def _decoder_layers(model: nn.Module) -> nn.ModuleList | None:
    """The base model's ModuleList of decoder layers (``model.model.layers``), if it has one."""
    base = getattr(model, getattr(model, "base_model_prefix", "") or "", None)
    layers = getattr(base, "layers", None)
    return layers if isinstance(layers, nn.ModuleList) and len(layers) > 0 else None
