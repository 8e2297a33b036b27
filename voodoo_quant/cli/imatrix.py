"""`voodoo imatrix`: compute an importance matrix from calibration tokens (GGUF format)."""

from __future__ import annotations

from typing import Optional

import typer

from .common import console, report_errors


def register(app: typer.Typer) -> None:
    @app.command("imatrix")
    @report_errors
    def imatrix(
        model: str = typer.Option(..., "--model", help="HF checkpoint dir."),
        tokens: str = typer.Option(..., "--tokens", help="Calibration tokens (train_tokens.pt from `voodoo data`)."),
        output: str = typer.Option("imatrix.gguf", "--output", help="Where to write the GGUF imatrix."),
        max_sequences: Optional[int] = typer.Option(None, "--max_sequences", help="Use at most this many sequences."),
        batch_size: int = typer.Option(1, "--batch_size", help="Sequences per forward pass."),
        base_checkpoint: Optional[str] = typer.Option(None, "--base_checkpoint", help="Base .pt replacing the checkpoint's weights."),
        text_model_class: Optional[str] = typer.Option(None, "--text_model_class", help="Text-only class of a multimodal wrapper."),
    ) -> None:
        """Compute an importance matrix in torch and write it as llama-quantize reads it."""
        from ..tools.calibrate import ImatrixConfig, compute  # lazy: keeps `voodoo --help` light

        imx = compute(ImatrixConfig(model, tokens, output, max_sequences, batch_size, base_checkpoint, text_model_class))
        console.print(f"wrote {output}: {len(imx.entries)} tensors, {imx.chunk_count} chunks")
