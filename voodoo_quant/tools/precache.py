"""`voodoo precache`: build the candidate cache for a model and its menus ahead of training.

Pure-CPU ggml work, parallel across ``--workers`` processes (one long-lived pool, so the seconds
that IQ types take to initialize are paid once per worker). A second run finds every candidate
cached and returns in seconds; training then starts without quantizing anything.

At scale: the weights are read one tensor at a time (a skeleton model and a
:class:`~voodoo_quant.model.lazyload.WeightReader`, never the whole float model), and ``--shard i/n``
splits the tensors over n processes or hosts writing one cache directory (a shared file system):
each computes the same cost-balanced split and builds only its part; the n parts together are
exactly the entries one run builds, and concurrent writers keep the cache consistent
(:meth:`voodoo_quant.candidates.cache.CandidateCache.put`).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..arch import adapter_for
from ..candidates.cache import CandidateCache
from ..candidates.precache import build_all, job_cost, parse_shard, split_by_cost
from ..core import envs
from ..core.errors import ConfigError
from ..gguf import imatrix as im
from ..model import modeling
from ..model.lazyload import WeightReader, text_skeleton
from ..selection.menus import DEFAULT_CANDIDATES, MenuConfig, default_fill
from ..student.build import converter_layouts, plan_model, selectable_weights
from ..training.models import load_into
from ..training.setup import _ReaderWeights, _jobs, imatrix_vectors


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
    shard: str | None = None  # "i/n": build only part i of n (1-based)
    fill_menus: bool | None = None  # as TrainConfig.fill_menus: None fills the default menu

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.workers is not None and self.workers < 1:
            raise ConfigError(f"--workers must be >= 1, got {self.workers}")
        parse_shard(self.shard)
        if self.fill_menus is None:
            self.fill_menus = default_fill(self.candidate_types, self.attention_candidates, self.non_attention_candidates)
        menus = MenuConfig(self.candidate_types or DEFAULT_CANDIDATES, self.attention_candidates,
                           self.non_attention_candidates)
        self.candidate_types = menus.candidate_types
        self.attention_candidates = menus.attention_candidates
        self.non_attention_candidates = menus.non_attention_candidates

    @property
    def menus(self) -> MenuConfig:
        return MenuConfig(self.candidate_types, self.attention_candidates, self.non_attention_candidates,
                          fill=bool(self.fill_menus))


def precache(cfg: PrecacheConfig, *, progress: bool = True):
    """Build every candidate of every selectable tensor (of this ``--shard``); returns the BuildReport."""
    import torch

    from pathlib import Path

    if Path(cfg.model).is_dir() and any(Path(cfg.model).glob("*.safetensors")):
        model = text_skeleton(cfg.model, cfg.text_model_class)  # no weight is read until a job needs it
        reader = WeightReader(cfg.model, model, checkpoint=cfg.base_checkpoint)
    else:
        model = modeling.load_model(cfg.model, text_model_class=cfg.text_model_class, dtype=torch.float32)
        if cfg.base_checkpoint:
            load_into(model, cfg.base_checkpoint, "base checkpoint")
        reader = None
    imx = None
    if cfg.imatrix:
        imx = im.load(cfg.imatrix)
    adapter = adapter_for(model.config)
    plans = plan_model(model, adapter, cfg.menus, imatrix_names=set(imx.entries) if imx else None,
                       layout_for=converter_layouts(cfg.model))
    shard = parse_shard(cfg.shard)
    if shard is not None:
        costs = {p.name: sum(job_cost(t, p.rows * p.n_per_row, imx is not None) for t in p.menu.types) for p in plans}
        mine = split_by_cost(costs, *shard)
        plans = [p for p in plans if p.name in mine]
    if reader is not None:
        weights = _ReaderWeights(reader, {p.name: p.shape for p in plans})
    else:
        weights = {n: w for n, (w, _) in selectable_weights(model).items()}
    jobs = _jobs(plans, weights, imatrix_vectors(imx, plans))
    return build_all(jobs, CandidateCache(), workers=cfg.workers or envs.quant_workers(), progress=progress)
