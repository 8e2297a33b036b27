"""`voodoo eval`: PPL and KL against the teacher, in torch or for GGUFs in stock llama-perplexity."""

from __future__ import annotations

from dataclasses import asdict
from pathlib import Path
from typing import List, Optional

import typer
from rich.table import Table

from ..core.errors import ConfigError
from .common import console, report_errors
from .options import add_aliases


def _fmt(v, spec: str) -> str:
    return "—" if v is None else format(v, spec)


def rows_table(rows: list[dict], title: str) -> Table:
    t = Table(title=title)
    for col in ("model", "size MB", "bpw", "PPL", "KLD mean", "± s.e.", "median", "p99", "p99.9", "same top %"):
        t.add_column(col, justify="left" if col == "model" else "right")
    for r in rows:
        size = None if r.get("size_bytes") is None else r["size_bytes"] / 1e6
        t.add_row(r["name"], _fmt(size, ".2f"), _fmt(r.get("bpw"), ".3f"), _fmt(r["ppl"], ".4f"),
                  _fmt(r.get("kld_mean"), ".6f"), _fmt(r.get("kld_stderr"), ".6f"), _fmt(r.get("kld_median"), ".6f"),
                  _fmt(r.get("kld_p99"), ".6f"),
                  _fmt(r.get("kld_p999"), ".6f"), _fmt(r.get("same_top_p"), ".3f"))
    return t


def register(app: typer.Typer) -> None:
    add_aliases("eval", {"threads": "workers"})

    @app.command("eval")
    @report_errors
    def _cmd(
        gguf: List[Path] = typer.Option([], "--gguf", help="GGUF files to evaluate in llama-perplexity (space separated, or the flag repeated)."),
        reference: Optional[Path] = typer.Option(None, "--reference", help="GGUF whose logits are the KL base (e.g. the F16 teacher)."),
        text: Optional[Path] = typer.Option(None, "--text", help="Raw text file for llama-perplexity -f."),
        eval_tokens: Optional[Path] = typer.Option(None, "--eval_tokens", "--eval-tokens", help="eval_tokens.pt from `voodoo data`."),
        tokenizer: Optional[str] = typer.Option(None, "--tokenizer", help="Tokenizer to detokenize --eval_tokens for GGUF eval (default: --reference)."),
        ctx: int = typer.Option(512, "-c", "--ctx", help="llama-perplexity context: chunks of this many tokens, second half scored."),
        chunks: Optional[int] = typer.Option(None, "--chunks", help="Max chunks for llama-perplexity (default all)."),
        workers: Optional[int] = typer.Option(None, "--workers", help="llama-perplexity -t (default VOODOO_QUANT_WORKERS)."),
        model: Optional[str] = typer.Option(None, "--model", help="Torch eval: the student (HF dir, GGUF, or a voodoo .pt)."),
        teacher_checkpoint: Optional[Path] = typer.Option(None, "--teacher_checkpoint", "--teacher-checkpoint",
                                                          help="Torch eval: the Q8_0 teacher .pt from make-teacher."),
        batch_size: int = typer.Option(1, "--batch_size", "--batch-size"),
        max_sequences: Optional[int] = typer.Option(None, "--max_sequences", "--max-sequences"),
        device: str = typer.Option("cpu", "--device"),
        output_json: Optional[Path] = typer.Option(None, "--output_json", "--output-json", help="Write the numbers as JSON."),
        plot: Optional[Path] = typer.Option(None, "--plot", help="GGUF eval: PNG of mean KLD (log) against file size."),
    ) -> None:
        """Evaluate GGUFs with stock llama-perplexity (--gguf) or a torch model (--model)."""
        if gguf and model:
            raise ConfigError("give --gguf files (llama.cpp) or --model (torch), not both")
        if gguf:
            from ..tools.evaluate import GGUFEvalConfig, evaluate_ggufs  # lazy: keeps `voodoo --help` light

            if reference is None:
                raise ConfigError("--gguf needs --reference GGUF (the model whose logits are the KL base)")
            cfg = GGUFEvalConfig(files=list(gguf), reference=reference, text=text, eval_tokens=eval_tokens,
                                 tokenizer=tokenizer, ctx=ctx, chunks=chunks, workers=workers,
                                 output_json=output_json, plot=plot)
            res = evaluate_ggufs(cfg)
            console.print(rows_table(res["rows"], f"KLD vs {reference.name} (PPL {res['reference']['ppl']:.4f}), -c {ctx}"))
        elif model:
            from ..tools.evaluate import TorchEvalConfig, evaluate_torch_cli  # lazy: keeps `voodoo --help` light

            if eval_tokens is None:
                raise ConfigError("torch eval needs --eval_tokens")
            row = evaluate_torch_cli(TorchEvalConfig(model=model, eval_tokens=eval_tokens, teacher_checkpoint=teacher_checkpoint,
                                                     batch_size=batch_size, max_sequences=max_sequences, device=device,
                                                     output_json=output_json))
            title = "torch eval" + (f" vs teacher (PPL {row.ppl_base:.4f})" if row.ppl_base else "")
            console.print(rows_table([asdict(row)], title))
        else:
            raise ConfigError("nothing to evaluate: give --gguf FILE ... --reference GGUF, or --model")
        if output_json:
            console.print(f"JSON: {output_json}")
