"""The teacher's forward, reused across trainings of the same teacher on the same batches.

Every size of a ladder trains on the same token batches (the batch order is a function of the
seed, the batch size and the tokens file: ``schedule.batch_indices``) against the same frozen
teacher, so the teacher's forward pass is the same work repeated per size. Both loss paths of
``training/losses.py`` use the teacher only through its final hidden states followed by its LM
head (the chunked path calls ``model.<base_model_prefix>(...).last_hidden_state`` and applies the
head per chunk; the full path's ``logits`` are ``lm_head(last_hidden_state)`` in
``LlamaForCausalLM.forward`` and its peers), so caching the hidden states of a batch, keyed by
the teacher and the batch's tokens, and applying the teacher's own head to them again gives the
very values a fresh forward gives — exact, not an approximation.

The cache is used only where that holds (``losses.chunk_reason(teacher) is None``: a plain Linear
head on the base model's output, no logit transform). Its first hit in a process is checked
against a fresh forward, bit for bit; a mismatch (another torch build or thread count that sums
in another order) drops the cache for the run and says so, so a cache never changes a result.
"""

from __future__ import annotations

import hashlib
import logging
from pathlib import Path
from types import SimpleNamespace

import torch
import torch.nn as nn

from ..core import fileio
from ..model.lm_head import chunk_reason

log = logging.getLogger(__name__)


def tokens_key(ids: torch.Tensor) -> str:
    h = hashlib.sha256(str(tuple(ids.shape)).encode())
    h.update(ids.detach().to("cpu", torch.int64).contiguous().numpy().tobytes())
    return h.hexdigest()[:32]


class HiddenStateCache:
    """``<directory>/<tokens key>.pt``: one teacher's final hidden states per token batch."""

    def __init__(self, directory: str | Path):
        self.directory = Path(directory)
        self.hits = 0
        self.misses = 0
        self.verified = False
        self.disabled = False

    def path(self, ids: torch.Tensor) -> Path:
        return self.directory / f"{tokens_key(ids)}.pt"

    def hidden(self, base: nn.Module, ids: torch.Tensor) -> torch.Tensor:
        """The teacher base model's last hidden state for `ids`, from the cache when it holds it."""
        if self.disabled:
            return base(input_ids=ids).last_hidden_state
        p = self.path(ids)
        if p.is_file():
            h = fileio.torch_load(p, what="cached teacher hidden states")
            if isinstance(h, torch.Tensor) and h.shape[:2] == ids.shape:
                h = h.to(ids.device)
                if not self.verified:
                    fresh = base(input_ids=ids).last_hidden_state
                    self.verified = True
                    if fresh.dtype != h.dtype or not torch.equal(fresh, h):
                        log.warning("cached teacher hidden states in %s differ from a fresh forward (another torch "
                                    "build or thread count?): not using the cache in this run", self.directory)
                        self.disabled = True
                        return fresh
                self.hits += 1
                return h
        h = base(input_ids=ids).last_hidden_state
        self.misses += 1
        fileio.torch_save(p, h.detach().to("cpu").contiguous())
        return h


class _CachedBase(nn.Module):
    """Stands in for the teacher's base model: returns its last hidden state through the cache."""

    def __init__(self, base: nn.Module, cache: HiddenStateCache):
        super().__init__()
        self.base = base
        self.cache = cache

    def forward(self, input_ids: torch.Tensor, **_kw):
        return SimpleNamespace(last_hidden_state=self.cache.hidden(self.base, input_ids))


class CachedTeacher(nn.Module):
    """A frozen causal LM whose base-model forward comes from a :class:`HiddenStateCache`.

    ``teacher(input_ids=ids).logits`` is ``head(hidden)`` (the full-logits path of
    ``losses.distill_terms``) and ``getattr(teacher, teacher.base_model_prefix)(input_ids=ids)``
    returns the hidden states (its chunked path); the head is the teacher's own module.
    """

    def __init__(self, teacher: nn.Module, cache: HiddenStateCache):
        super().__init__()
        why = chunk_reason(teacher)
        if why is not None:
            raise ValueError(f"the teacher's logits are not its head applied to its hidden states: {why}")
        self.inner = teacher
        self.cache = cache
        self.config = teacher.config
        self.base_model_prefix = teacher.base_model_prefix
        # Registered under the prefix name, where losses._hidden looks for the base model.
        setattr(self, self.base_model_prefix, _CachedBase(getattr(teacher, teacher.base_model_prefix), cache))

    def get_output_embeddings(self) -> nn.Module:
        return self.inner.get_output_embeddings()

    def forward(self, input_ids: torch.Tensor, **_kw):
        h = getattr(self, self.base_model_prefix)(input_ids=input_ids).last_hidden_state
        return SimpleNamespace(logits=self.inner.get_output_embeddings()(h))


def wrap_teacher(teacher: nn.Module, directory: str | Path) -> tuple[nn.Module, HiddenStateCache | None]:
    """(`teacher` behind a hidden-state cache in `directory`, the cache), or (`teacher`, None)
    with the reason logged where its logits are not ``head(hidden)``."""
    why = chunk_reason(teacher)
    if why is not None:
        log.info("teacher forward not cached: %s", why)
        return teacher, None
    cache = HiddenStateCache(directory)
    return CachedTeacher(teacher, cache), cache
