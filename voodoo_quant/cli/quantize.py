"""`voodoo quantize`: flags → QuantizeConfig → voodoo_quant.tools.quantize.quantize.

Train flags beyond the ones below go after a bare ``--`` exactly as `voodoo train` spells them
(``voodoo quantize ... -- --lr 0.3 --no_polish``): they are parsed by the train command itself,
so every train flag, present and future, works here.
"""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from ..training.config import SEQ_LEN
from .common import console, report_errors
from .options import add_aliases
from .tp import parse_train_flags

T = "Training"
E = "Evaluation and card"


def _csv(v: Optional[List[str]]) -> list[str]:
    return [p for item in (v or []) for p in str(item).replace(",", " ").split() if p]


def _paths(v: Optional[List[str]]) -> list[str]:
    """Paths of a list flag: its values, each of which may also hold several, comma separated."""
    return [p for item in (v or []) for p in str(item).split(",") if p]


def train_extra(args: list[str]) -> dict:
    """The TrainConfig fields that the train flags `args` set to something other than the default."""
    if not args:
        return {}
    if args[0] == "--":
        args = args[1:]
    req = ["--model", "placeholder", "--compression_ratio", "0.5"]
    base = parse_train_flags(req).to_dict()
    given = parse_train_flags(req + list(args)).to_dict()
    # a flag given explicitly counts even where it equals the default here: a default that other
    # flags resolve (fill_menus follows the menu) may differ once quantize's own flags apply
    named = {a.lstrip("-").replace("-", "_").split("=")[0] for a in args if a.startswith("--")}
    named |= {n[len("no_"):] for n in named if n.startswith("no_")}
    return {k: v for k, v in given.items() if v != base[k] or k in named}


def register(app: typer.Typer) -> None:
    add_aliases("quantize", {"steps": "max_steps", "eval_ctx": "ctx", "eval_chunks": "chunks", "threads": "workers"})

    @app.command("quantize", context_settings={"allow_extra_args": True, "ignore_unknown_options": False})
    @report_errors
    def quantize(
        context: typer.Context,
        model: str = typer.Option(..., "--model", help="HF checkpoint dir or GGUF file."),
        text: List[str] = typer.Option(..., "--text", help="Text files, folders or .jsonl files (space separated)."),
        sizes: List[str] = typer.Option(["30", "45", "60"], "--sizes", help="Standard sizes: percent of uniform Q8_0 (30 45 60 → Voodoo30/45/60)."),
        output_dir: Path = typer.Option(..., "--output_dir", help="The ladder: GGUFs, imatrix, eval, card; work files under work/."),
        model_name: Optional[str] = typer.Option(None, "--model_name", help="<Model> in the file names (default: from the model's name)."),
        seq_len: int = typer.Option(SEQ_LEN, "--seq_len", help="Tokens per training sequence.", rich_help_panel=T),
        eval_fraction: float = typer.Option(0.1, "--eval_fraction", help="Held-out fraction of the documents (eval text)."),
        eval_text: Optional[List[str]] = typer.Option(None, "--eval_text", help="Explicit held-out documents instead of --eval_fraction."),
        glob: str = typer.Option("*", "--glob", help="File pattern inside text folders."),
        degrid_seed: Optional[int] = typer.Option(None, "--degrid_seed", help="De-grid a model whose weights are a dequantized quant (see make-teacher)."),
        calib_sequences: int = typer.Option(64, "--calib_sequences", help="Train sequences the imatrix is computed on."),
        max_steps: int = typer.Option(50, "--max_steps", help="Training steps per size.", rich_help_panel=T),
        target_size: Optional[str] = typer.Option(None, "--target_size", metavar="SIZE", help="One file of at most this size (the whole file: 1.2GB, 800MiB or bytes), named by the one size in --sizes.", rich_help_panel=T),
        batch_size: int = typer.Option(1, "--batch_size", help="Sequences per step.", rich_help_panel=T),
        candidate_types: Optional[List[str]] = typer.Option(None, "--candidate_types", help="Default menu (as `voodoo train`).", rich_help_panel=T),
        attention_candidates: Optional[List[str]] = typer.Option(None, "--attention_candidates", help="Menu of the attention family.", rich_help_panel=T),
        non_attention_candidates: Optional[List[str]] = typer.Option(None, "--non_attention_candidates", help="Menu of every other tensor.", rich_help_panel=T),
        seed: int = typer.Option(0, "--seed", help="Seed of the data split and the batch order.", rich_help_panel=T),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N.", rich_help_panel=T),
        dtype: str = typer.Option("float32", "--dtype", help="Training dtype.", rich_help_panel=T),
        lazy: bool = typer.Option(False, "--lazy", help="Keep candidates packed (less memory).", rich_help_panel=T),
        share_teacher_forward: bool = typer.Option(True, "--share_teacher_forward/--no_share_teacher_forward", help="Cache the teacher's hidden states per batch for the other sizes (exact).", rich_help_panel=T),
        stock: Optional[List[str]] = typer.Option(None, "--stock", help="Stock llama-quantize recipes to compare with (default: each size's badge; Q8_0 always).", rich_help_panel=E),
        eval: bool = typer.Option(True, "--eval/--no_eval", help="Evaluate every file in stock llama-perplexity.", rich_help_panel=E),
        ctx: int = typer.Option(512, "--ctx", help="-c of llama-perplexity.", rich_help_panel=E),
        chunks: int = typer.Option(20, "--chunks", help="llama-perplexity chunks.", rich_help_panel=E),
        workers: Optional[int] = typer.Option(None, "--workers", help="Threads of the stock tools (default VOODOO_QUANT_WORKERS).", rich_help_panel=E),
        license: Optional[str] = typer.Option(None, "--license", help="Card license (default: the source's own).", rich_help_panel=E),
        base_model: Optional[str] = typer.Option(None, "--base_model", help="Card base_model (default: the source's own).", rich_help_panel=E),
    ) -> None:
        """A model and text → a ladder of Voodoo GGUFs, evaluated against stock recipes, with a model card.
        Extra `voodoo train` flags go after `--`."""
        import os

        # One display for the whole ladder: tqdm bars of the libraries it calls (transformers'
        # GGUF loader) would break it up. Read by tqdm when it is first imported, i.e. below.
        os.environ.setdefault("TQDM_DISABLE", "1")
        from ..tools.quantize import QuantizeConfig, quantize as run  # lazy: keeps `voodoo --help` light
        from .quantize_report import print_summary  # lazy: keeps `voodoo --help` light

        cfg = QuantizeConfig(
            model=model, texts=_paths(text), sizes=tuple(_csv(sizes)), output_dir=output_dir, model_name=model_name,
            seq_len=seq_len, eval_fraction=eval_fraction, eval_texts=_paths(eval_text), glob=glob, degrid_seed=degrid_seed,
            calib_sequences=calib_sequences, max_steps=max_steps, target_size=target_size, batch_size=batch_size,
            candidate_types=tuple(_csv(candidate_types)) or None,
            attention_candidates=tuple(_csv(attention_candidates)) or None,
            non_attention_candidates=tuple(_csv(non_attention_candidates)) or None,
            seed=seed, device=device, dtype=dtype, lazy=lazy, train_extra=train_extra(list(context.args)),
            share_teacher_forward=share_teacher_forward, stock=tuple(_csv(stock)) or None, eval=eval,
            ctx=ctx, chunks=chunks, workers=workers, license=license, base_model=base_model,
        )
        result = run(cfg)
        print_summary(console, cfg, result)
