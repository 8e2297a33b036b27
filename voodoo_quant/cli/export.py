"""`voodoo export`: flags → ExportConfig → voodoo_quant.tools.export.export."""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from .common import console, report_errors


def register(app: typer.Typer) -> None:
    @app.command("export")
    @report_errors
    def _cmd(
        model: Path = typer.Option(..., "--model", help="HF checkpoint dir (config, tokenizer, safetensors)."),
        assignment: Path = typer.Option(..., "--assignment", help="assignment.json written by `voodoo train`."),
        output_dir: Path = typer.Option(..., "--output_dir", "--output-dir", help="Where the GGUF and its tensor-type file go."),
        base_checkpoint: Optional[Path] = typer.Option(None, "--base_checkpoint", "--base-checkpoint", help="A .pt state dict whose weights replace the checkpoint's."),
        imatrix: Optional[Path] = typer.Option(None, "--imatrix", help="The imatrix the candidates were built with (GGUF or .dat); default: the one the assignment records (its sha256 is checked either way)."),
        output_name: Optional[str] = typer.Option(None, "--output_name", "--output-name", help="File name (default: <Model>.Voodoo<NN>_<BADGE>.gguf)."),
        size_percent: Optional[int] = typer.Option(None, "--size_percent", "--size-percent", help="Size for the canonical name (45 → Voodoo45_IQ2_M; a size without a badge, e.g. 85 → Voodoo85)."),
        model_name: Optional[str] = typer.Option(None, "--model_name", "--model-name", help="<Model> in the canonical name (default: the model dir's name)."),
        overwrite: bool = typer.Option(False, "--overwrite", help="Replace an existing output file."),
        converted: Optional[Path] = typer.Option(None, "--converted", help="The F32 GGUF of --model made earlier by llama.cpp's convert_hf_to_gguf.py (--outtype f32): read instead of converting again into the temp dir. Its quantized tensors must hash to the weights the assignment records."),
        allow_mismatch: bool = typer.Option(False, "--allow_mismatch", "--allow-mismatch", help="Experts: export even when the imatrix, base weights, libggml or menus differ from what the assignment records (or it records none); each mismatch is logged."),
    ) -> None:
        """Write the assignment as one GGUF that stock llama.cpp loads and runs."""
        from ..tools.export import ExportConfig, export  # lazy: keeps `voodoo --help` light

        cfg = ExportConfig(
            model=model, assignment=assignment, output_dir=output_dir, base_checkpoint=base_checkpoint,
            imatrix=imatrix, output_name=output_name, size_percent=size_percent, model_name=model_name,
            overwrite=overwrite, converted=converted, allow_mismatch=allow_mismatch,
        )
        r = export(cfg)
        types = ", ".join(f"{k}×{v}" for k, v in r.types.items())
        console.print(f"wrote {r.path} ({r.nbytes:,} bytes, {r.bpw:.3f} bpw selected, {r.file_bpw:.3f} bpw file; {types})")
        if r.fixed:
            kinds = ", ".join(f"{k}×{v}" for k, v in sorted(_count(r.fixed.values()).items()))
            console.print(f"{len(r.fixed)} quantizable tensor(s) not on the assignment, written as llama-quantize's base "
                          f"type would ({kinds}; {r.fixed_bytes:,} bytes, in the totals above)")
        console.print(f"imatrix: {r.imatrix or 'none'}")
        console.print(f"tensor types: {r.tensor_type_file}")


def _count(values) -> dict[str, int]:
    out: dict[str, int] = {}
    for v in values:
        out[v] = out.get(v, 0) + 1
    return out
