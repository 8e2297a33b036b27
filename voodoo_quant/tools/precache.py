"""`voodoo precache`: build the candidate cache for a model and its menus ahead of training.

Pure-CPU ggml work, parallel across ``--workers`` processes (one long-lived pool, so the seconds
that IQ types take to initialize are paid once per worker). A second run finds every candidate
cached and returns in seconds; training then starts without quantizing anything.
"""

from __future__ import annotations

from dataclasses import dataclass

from .. import envs
from ..errors import ConfigError
from ..menus import DEFAULT_CANDIDATES, MenuConfig


@dataclass
class PrecacheConfig:
    model: str
    base_checkpoint: str | None = None
    text_model_class: str | None = None
    candidate_types: tuple[str, ...] = DEFAULT_CANDIDATES
    attention_candidates: tuple[str, ...] | None = None
    non_attention_candidates: tuple[str, ...] | None = None
    imatrix: str | None = None
    workers: int | None = None

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        menus = MenuConfig(self.candidate_types or DEFAULT_CANDIDATES, self.attention_candidates,
                           self.non_attention_candidates)
        self.candidate_types = menus.candidate_types
        self.attention_candidates = menus.attention_candidates
        self.non_attention_candidates = menus.non_attention_candidates

    @property
    def menus(self) -> MenuConfig:
        return MenuConfig(self.candidate_types, self.attention_candidates, self.non_attention_candidates)


def precache(cfg: PrecacheConfig, *, progress: bool = True):
    """Build every candidate of every selectable tensor; returns the precache BuildReport."""
    import torch

    from ..arch import adapter_for
    from ..cache import CandidateCache
    from ..modeling import load_model
    from ..precache import build_all
    from ..student import candidate_jobs, plan_model, selectable_weights
    from ..training.setup import _load_into, imatrix_vectors

    model = load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
    if cfg.base_checkpoint:
        _load_into(model, cfg.base_checkpoint, "base checkpoint")
    imx = None
    if cfg.imatrix:
        from .. import imatrix as im

        imx = im.load(cfg.imatrix)
    from ..student import converter_layouts

    adapter = adapter_for(model.config)
    plans = plan_model(model, adapter, cfg.menus, imatrix_names=set(imx.entries) if imx else None,
                       layout_for=converter_layouts(cfg.model))
    weights = {n: w for n, (w, _) in selectable_weights(model).items()}
    jobs = candidate_jobs(plans, weights, imatrix_vectors(imx, plans))
    return build_all(jobs, CandidateCache(), workers=cfg.workers or envs.quant_workers(), progress=progress)
