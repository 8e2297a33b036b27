"""`voodoo data`: tokenize a corpus into train_tokens.pt / eval_tokens.pt + meta.json."""

from __future__ import annotations

from pathlib import Path
from typing import List, Optional

import typer

from .common import console, report_errors


def register(app: typer.Typer) -> None:
    @app.command("data")
    @report_errors
    def _cmd(
        inputs: List[str] = typer.Argument(None, help="Text files, folders (recursive, --glob) or .jsonl files."),
        model: str = typer.Option(..., "--model", help="Tokenizer source: HF dir, GGUF file, or hub id."),
        output_dir: Path = typer.Option(..., "--output_dir", "--output-dir", help="Where the token files go."),
        seq_len: int = typer.Option(2048, "--seq_len", "--seq-len", help="Tokens per sequence."),
        eval_fraction: float = typer.Option(0.1, "--eval_fraction", "--eval-fraction",
                                            help="Fraction of documents held out for eval (ignored with --eval_files)."),
        eval_files: List[str] = typer.Option([], "--eval_files", "--eval-files",
                                             help="Explicit eval inputs (repeatable); all other inputs are train."),
        glob: str = typer.Option("*", "--glob", help="File pattern inside folders."),
        text_field: str = typer.Option("text", "--text_field", "--text-field", help="Field of .jsonl rows / dataset columns."),
        dataset: Optional[str] = typer.Option(None, "--dataset", help="A `datasets` hub name (network permitting)."),
        dataset_split: str = typer.Option("train", "--dataset_split", "--dataset-split"),
        seed: int = typer.Option(0, "--seed", help="Seed of the document split."),
    ) -> None:
        """Tokenize text into train/eval sequences, split by document."""
        from ..tools.data import DataConfig, make_data  # lazy: keeps `voodoo --help` light

        cfg = DataConfig(model=model, inputs=list(inputs or []), output_dir=output_dir, seq_len=seq_len,
                         eval_fraction=eval_fraction, eval_files=list(eval_files), glob=glob,
                         text_field=text_field, dataset=dataset, dataset_split=dataset_split, seed=seed)
        r = make_data(cfg)
        m = r.meta
        console.print(f"train: {m['train']['sequences']} × {cfg.seq_len} tokens ({m['train']['documents']} documents) → {r.train_path}")
        console.print(f"eval:  {m['eval']['sequences']} × {cfg.seq_len} tokens ({m['eval']['documents']} documents) → {r.eval_path}")
        console.print(f"meta:  {r.meta_path}")
