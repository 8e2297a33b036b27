"""`voodoo precache`: parse flags into a PrecacheConfig and build the candidate cache."""

from __future__ import annotations

from typing import List, Optional

import typer

from ..training.config import TRAIN_DEFAULTS as _TRAIN
from .common import console, report_errors


def register(app: typer.Typer) -> None:
    @app.command("precache")
    @report_errors
    def precache(
        model: str = typer.Option(..., "--model", help="HF checkpoint dir."),
        base_checkpoint: Optional[str] = typer.Option(None, "--base_checkpoint", help="Base .pt state dict replacing the checkpoint's weights."),
        text_model_class: Optional[str] = typer.Option(None, "--text_model_class", help="Text-only class of a multimodal wrapper."),
        candidate_types: Optional[List[str]] = typer.Option(None, "--candidate_types", help="Default menu (space or comma separated)."),
        attention_candidates: Optional[List[str]] = typer.Option(None, "--attention_candidates", help="Menu of the attention family."),
        non_attention_candidates: Optional[List[str]] = typer.Option(None, "--non_attention_candidates", help="Menu of every other tensor."),
        fill_menus: Optional[bool] = typer.Option(None, "--fill_menus/--no_fill_menus", help="As in `voodoo train`: where a menu's types fall back on a tensor's row length, also build the row's other types in the menu's size range (default: on for the default menu)."),
        imatrix: Optional[str] = typer.Option(None, "--imatrix", help="llama.cpp imatrix (GGUF or legacy .dat)."),
        workers: Optional[int] = typer.Option(None, "--workers", help="Worker processes (default VOODOO_QUANT_WORKERS, else all cores)."),
        shard: Optional[str] = typer.Option(None, "--shard", help="i/n: build only part i of n (1-based) of the tensors, balanced by cost; n processes or hosts sharing one cache directory (VOODOO_CACHE_DIR) fill it together."),
        error_compensation: str = typer.Option("none", "--error_compensation", help="gptq: build the compensated candidates a training run with --error_compensation gptq (train's default, auto) uses, from the run's Hessians (--output_dir)."),
        output_dir: Optional[str] = typer.Option(None, "--output_dir", help="The training run's --output_dir: its hessians.safetensors is reused when its key matches, else collected there."),
        data_dir: str = typer.Option(_TRAIN["data_dir"], "--data_dir", help="The run's --data_dir: its training tokens key (and make) the Hessians."),
        data_name: str = typer.Option(_TRAIN["data_name"], "--data_name", help="The run's --data_name."),
        seq_len: int = typer.Option(_TRAIN["seq_len"], "--seq_len", help="The run's --seq_len."),
        compensation_sequences: int = typer.Option(_TRAIN["compensation_sequences"], "--compensation_sequences", help="The run's --compensation_sequences."),
        compensation_damp: float = typer.Option(_TRAIN["compensation_damp"], "--compensation_damp", help="The run's --compensation_damp."),
        compensation_sweep: str = typer.Option(_TRAIN["compensation_sweep"], "--compensation_sweep", help="The run's --compensation_sweep."),
        search_sequences: int = typer.Option(_TRAIN["search_sequences"], "--search_sequences", help="The run's --search_sequences (held aside, not calibration)."),
        search_confirm: int = typer.Option(_TRAIN["search_confirm"], "--search_confirm", help="The run's --search_confirm (held aside too)."),
    ) -> None:
        """Build the candidate cache for a model and its menus ahead of training."""
        from ..tools.precache import PrecacheConfig, precache as run  # lazy: keeps `voodoo --help` light

        cfg = PrecacheConfig(model, base_checkpoint, text_model_class, candidate_types or None,
                             attention_candidates or None, non_attention_candidates or None, imatrix, workers, shard,
                             fill_menus=fill_menus, error_compensation=error_compensation, output_dir=output_dir,
                             data_dir=data_dir, data_name=data_name, seq_len=seq_len,
                             compensation_sequences=compensation_sequences, compensation_damp=compensation_damp,
                             compensation_sweep=compensation_sweep,
                             search_sequences=search_sequences, search_confirm=search_confirm)
        rep = run(cfg)
        part = f"shard {shard}: " if shard else ""
        console.print(
            f"{part}candidates: {rep.cached + rep.built} ({rep.cached} already cached, {rep.built} built, "
            f"{rep.bytes_built / 1e6:,.1f} MB written) in {rep.seconds:.1f} s"
        )
