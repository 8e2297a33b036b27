"""`voodoo make-teacher`: the base .pt and the llama.cpp-exact Q8_0 teacher .pt."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Optional

import typer

from .common import console, report_errors


class BaseDType(str, Enum):
    bfloat16 = "bfloat16"
    float32 = "float32"


def register(app: typer.Typer) -> None:
    @app.command("make-teacher")
    @report_errors
    def _cmd(
        model: str = typer.Option(..., "--model", help="HF checkpoint dir (safetensors) or GGUF file."),
        output_dir: Path = typer.Option(..., "--output_dir", "--output-dir"),
        base_name: Optional[str] = typer.Option(None, "--base_name", "--base-name", help="Default: <model>_lm_base.pt"),
        teacher_name: Optional[str] = typer.Option(None, "--teacher_name", "--teacher-name",
                                                   help="Default: <model>_lm_teacher_q8_0.pt"),
        strip_prefix: Optional[str] = typer.Option(None, "--strip_prefix", "--strip-prefix",
                                                   help="Key prefix of the text model in a wrapper, e.g. model.language_model."),
        text_model_class: Optional[str] = typer.Option(None, "--text_model_class", "--text-model-class",
                                                       help="model_type (qwen3_5_text) or class of the text-only model."),
        dtype: BaseDType = typer.Option(BaseDType.bfloat16, "--dtype", help="dtype of the base checkpoint."),
        degrid_seed: Optional[int] = typer.Option(
            None, "--degrid_seed", "--degrid-seed",
            help="Add seeded uniform noise of ± half the grid step (smallest gap between the distinct values "
                 "of each --degrid_block-weight block) to every 2-D weight first: for models whose float weights are a "
                 "dequantized quantized file (e.g. the embedded SmolLM2 Q4_1). Deterministic per seed."),
        degrid_block: Optional[int] = typer.Option(
            None, "--degrid_block", "--degrid-block",
            help="Weights per block whose grid step sizes the noise: 32, or 16 for a file holding types with "
                 "16-weight sub-blocks (Q6_K, Q3_K, Q2_K), whose grids a 32-weight block would mix. Default: "
                 "16 for a GGUF holding such types, else 32."),
        hf_out: Optional[Path] = typer.Option(None, "--hf_out", "--hf-out",
                                              help="Also save the (de-gridded) float32 model as an HF checkpoint dir."),
    ) -> None:
        """Write the base checkpoint and the Q8_0 teacher from an HF dir or a GGUF file."""
        from ..tools.teacher import MakeTeacherConfig, make_teacher  # lazy: keeps `voodoo --help` light

        cfg = MakeTeacherConfig(model=model, output_dir=output_dir, base_name=base_name, teacher_name=teacher_name,
                                strip_prefix=strip_prefix, text_model_class=text_model_class, dtype=dtype.value,
                                degrid_seed=degrid_seed, degrid_block=degrid_block, hf_out=hf_out)
        r = make_teacher(cfg)
        console.print(f"base ({cfg.dtype}): {r.base_path}")
        console.print(f"teacher (Q8_0 on {r.q8_tensors} of {r.tensors} tensors): {r.teacher_path}")
        if r.hf_out:
            console.print(f"HF checkpoint: {r.hf_out}")
