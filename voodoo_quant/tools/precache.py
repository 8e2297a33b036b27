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

With ``--error_compensation gptq`` the candidates are the compensated ones a training run builds
(voodoo_quant/candidates/compensate.py), from the run's Hessians: ``<output_dir>/hessians.safetensors`` when
its key says it was collected from the same inputs (the same ``--model``, weights, planned
tensors and calibration sequences), else collected as train collects them (the first
``--compensation_sequences`` of the training split of ``<data_dir>/<data_name>``, one decoder layer
at a time on a checkpoint directory) and written there for the run. The compensation is the
costly part of a large model's candidates; ``--shard`` spreads it like the rest.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from ..arch import adapter_for
from ..candidates.cache import CandidateCache
from ..candidates.compensate import SWEEPS, QuantInputs, compensations
from ..candidates.hessian_store import FILE, load_hessians, read_key
from ..candidates.precache import build_all, job_cost, parse_shard, split_by_cost
from ..core import envs
from ..core.errors import ConfigError
from ..gguf import imatrix as im
from ..model import modeling
from ..model.lazyload import WeightReader, text_skeleton
from ..selection.menus import DEFAULT_CANDIDATES, MenuConfig, default_fill
from ..student.build import converter_layouts, plan_model, selectable_weights
from ..training.compensation import write_if_missing
from ..training.config import TRAIN_DEFAULTS
from ..training.hessians import hessian_key
from ..training.models import load_into
from ..training.provenance import model_weights_sha256
from ..training.setup import _ReaderWeights, _jobs, hold_aside, imatrix_vectors, load_tokens

_TRAIN = TRAIN_DEFAULTS  # the settings the run's Hessians are keyed by


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
    # error compensation: the run's Hessians, read from <output_dir> or collected as train does
    error_compensation: str = "none"
    output_dir: str | None = None  # the training run's --output_dir (its hessians.safetensors)
    data_dir: str = _TRAIN["data_dir"]
    data_name: str = _TRAIN["data_name"]
    seq_len: int = _TRAIN["seq_len"]
    compensation_sequences: int = _TRAIN["compensation_sequences"]
    compensation_damp: float = _TRAIN["compensation_damp"]
    compensation_sweep: str = _TRAIN["compensation_sweep"]
    search_sequences: int = _TRAIN["search_sequences"]  # the sequences train holds aside (not calibration)
    search_confirm: int = _TRAIN["search_confirm"]

    def __post_init__(self) -> None:
        if not self.model:
            raise ConfigError("--model is required")
        if self.error_compensation not in ("none", "gptq"):
            raise ConfigError(f"--error_compensation must be none or gptq, got {self.error_compensation!r}")
        if self.error_compensation == "gptq" and not self.output_dir:
            raise ConfigError("--error_compensation gptq needs the training run's --output_dir: its "
                              "hessians.safetensors is read there, or collected and written there for the run")
        for flag, v, lo in (("--seq_len", self.seq_len, 2), ("--compensation_sequences", self.compensation_sequences, 1),
                            ("--search_sequences", self.search_sequences, 0), ("--search_confirm", self.search_confirm, 0)):
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ConfigError(f"{flag} must be an integer >= {lo}, got {v!r}")
        if not (isinstance(self.compensation_damp, (int, float)) and 0 < self.compensation_damp < 1e3):
            raise ConfigError(f"--compensation_damp must be a number > 0, got {self.compensation_damp!r}")
        if self.compensation_sweep not in SWEEPS:
            raise ConfigError(f"--compensation_sweep must be one of {', '.join(SWEEPS)}, got {self.compensation_sweep!r}")
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
    import torch  # lazy: `voodoo precache --help` loads no torch

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
    vectors = imatrix_vectors(imx, plans)
    if cfg.error_compensation != "none":
        if reader is not None:
            model.voodoo_reader = reader  # a skeleton: the Hessians are collected layer by layer
        vectors = QuantInputs(vectors, run_compensations(cfg, model, plans, progress=progress))
    shard = parse_shard(cfg.shard)
    if shard is not None:
        costs = {p.name: sum(job_cost(t, p.rows * p.n_per_row, imx is not None) for t in p.menu.types) for p in plans}
        mine = split_by_cost(costs, *shard)
        plans = [p for p in plans if p.name in mine]
    if reader is not None:
        weights = _ReaderWeights(reader, {p.name: p.shape for p in plans})
    else:
        weights = {n: w for n, (w, _) in selectable_weights(model).items()}
    jobs = _jobs(plans, weights, vectors)
    return build_all(jobs, CandidateCache(), workers=cfg.workers or envs.quant_workers(), progress=progress)


def run_compensations(cfg: PrecacheConfig, model, plans, *, progress: bool = False):
    """HF name -> Compensation of the training run: its Hessians file, reused when its key
    matches (the key of every planned tensor, before any ``--shard`` takes its part), else
    collected on the calibration sequences train takes and written to ``<output_dir>``."""
    path = Path(cfg.output_dir) / FILE
    data = Path(cfg.data_dir) / cfg.data_name
    if not data.is_file():
        found = f"{path} holds the Hessians of key {read_key(path)}, but" if path.is_file() else f"no {path}, and"
        raise ConfigError(f"--error_compensation gptq: {found} the training tokens {data} that key them are missing; "
                          "pass the run's --data_dir / --data_name")
    tokens = load_tokens(data, cfg.seq_len)
    calib = hold_aside(tokens, cfg.search_sequences, cfg.search_confirm)[0][: cfg.compensation_sequences]
    key = hessian_key(plans, calib, cfg.model, model_weights_sha256(model, plans))
    write_if_missing(path, key, model, plans, calib, progress=progress)
    return compensations(load_hessians(path, key=key), cfg.compensation_damp, cfg.compensation_sweep)
