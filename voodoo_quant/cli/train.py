"""`voodoo train`: parse every trainer flag into a TrainConfig and run the trainer."""

from __future__ import annotations

from typing import List, Optional

import typer

from .common import console, report_errors

R = "Model and teacher"
B = "Budget"
M = "Menus"
O = "Optimization"
D = "Data and outputs"
H = "Hardware"
J = "Journal"
X = "Beyond the soft mixture"
F = "After the bake: guarantee and search"


def build_config(**kw):
    from ..training.config import STOCK_REFERENCES, TrainConfig  # lazy: keeps `voodoo --help` light

    refs = kw.get("stock_references")  # a list flag (unset: None from Typer, () from Click's own parse)
    kw["stock_references"] = STOCK_REFERENCES if not refs else tuple(" ".join(refs).replace(",", " ").split())
    return TrainConfig(**kw)


def register(app: typer.Typer) -> None:
    @app.command("train")
    @report_errors
    def train(
        model: str = typer.Option(..., "--model", help="HF checkpoint dir (config, tokenizer, safetensors).", rich_help_panel=R),
        base_checkpoint: Optional[str] = typer.Option(None, "--base_checkpoint", help="Base .pt state dict (from make-teacher) replacing the checkpoint's weights.", rich_help_panel=R),
        text_model_class: Optional[str] = typer.Option(None, "--text_model_class", help="Text-only class/model_type of a multimodal wrapper, e.g. qwen3_5_text.", rich_help_panel=R),
        teacher_quant: Optional[str] = typer.Option(None, "--teacher_quant", help="Teacher weights: omit for the float model, Q8_0 for its llama.cpp-exact Q8_0.", rich_help_panel=R),
        teacher_checkpoint: Optional[str] = typer.Option(None, "--teacher_checkpoint", help="Teacher .pt state dict (from make-teacher).", rich_help_panel=R),
        compression_ratio: Optional[float] = typer.Option(None, "--compression_ratio", help="Target size as a fraction of the selectable tensors at uniform Q8_0 (Voodoo45 = 0.45).", rich_help_panel=B),
        target_bits: Optional[float] = typer.Option(None, "--target_bits", help="Target bits per selectable weight (instead of --compression_ratio).", rich_help_panel=B),
        budget_reduction: float = typer.Option(0.0, "--budget_reduction", help="Train toward target × (1 − this) so post-hoc --tensor_upgrades land on target.", rich_help_panel=B),
        tensor_upgrades: Optional[str] = typer.Option(None, "--tensor_upgrades", help='JSON list of {"pattern": regex, "levels": ±n}: move matching tensors n rungs after the argmax.', rich_help_panel=B),
        size_weight: float = typer.Option(100.0, "--size_weight", help="Weight of the quadratic size penalty outside the dead zone.", rich_help_panel=B),
        size_tolerance: float = typer.Option(0.02, "--size_tolerance", help="Dead zone: no size penalty within ±this fraction of the target.", rich_help_panel=B),
        candidate_types: Optional[List[str]] = typer.Option(None, "--candidate_types", help="Default menu (space or comma separated): Q8_0 Q5_K IQ3_S IQ2_S IQ2_XXS IQ1_S.", rich_help_panel=M),
        attention_candidates: Optional[List[str]] = typer.Option(None, "--attention_candidates", help="Menu of the attention family (the adapter's attention_segments).", rich_help_panel=M),
        non_attention_candidates: Optional[List[str]] = typer.Option(None, "--non_attention_candidates", help="Menu of every other tensor.", rich_help_panel=M),
        fill_menus: Optional[bool] = typer.Option(None, "--fill_menus/--no_fill_menus", help="Where a menu's types fall back on a tensor's row length (rows not a multiple of 256), also offer every other type that row takes within the menu's size range. Default: on for the default menu, off for a menu you name.", rich_help_panel=M),
        imatrix: Optional[str] = typer.Option(None, "--imatrix", help="llama.cpp imatrix (GGUF or legacy .dat); required for IQ2_XXS/IQ2_XS/IQ1_S and others.", rich_help_panel=M),
        seq_len: int = typer.Option(512, "--seq_len", help="Tokens per sequence.", rich_help_panel=O),
        batch_size: int = typer.Option(1, "--batch_size", help="Sequences per step.", rich_help_panel=O),
        max_steps: int = typer.Option(100, "--max_steps", help="Gate training steps.", rich_help_panel=O),
        lr: float = typer.Option(0.5, "--lr", help="Adam learning rate of the gate logits.", rich_help_panel=O),
        distill_weight: float = typer.Option(1.0, "--distill_weight", help="λ: weight of KL(teacher ‖ student).", rich_help_panel=O),
        tau_start: float = typer.Option(1.0, "--tau_start", help="Softmax temperature at the first step.", rich_help_panel=O),
        tau_end: float = typer.Option(0.05, "--tau_end", help="Temperature at the last step (geometric annealing).", rich_help_panel=O),
        seed: int = typer.Option(0, "--seed", help="Seed of the batch order.", rich_help_panel=O),
        data_dir: str = typer.Option("data", "--data_dir", help="Directory of the tokens file.", rich_help_panel=D),
        data_name: str = typer.Option("train_tokens.pt", "--data_name", help="Tokens file written by `voodoo data`.", rich_help_panel=D),
        output_dir: str = typer.Option("runs/voodoo", "--output_dir", help="Where the journal and the outputs go.", rich_help_panel=D),
        output_name: str = typer.Option("voodoo.pt", "--output_name", help="Name of the result .pt (assignment, gates, config, metrics).", rich_help_panel=D),
        device: str = typer.Option("cpu", "--device", help="cpu, cuda or cuda:N (ROCm GPUs are cuda:N too).", rich_help_panel=H),
        dtype: str = typer.Option("float32", "--dtype", help="Training dtype: float32, bfloat16 or float16.", rich_help_panel=H),
        lazy: bool = typer.Option(False, "--lazy", help="Keep candidates packed; dequantize on the fly (less memory).", rich_help_panel=H),
        gradient_checkpointing: bool = typer.Option(False, "--gradient_checkpointing", help="Recompute activations in backward.", rich_help_panel=H),
        no_compile: bool = typer.Option(False, "--no_compile", help="Accepted for recipe compatibility; this version never compiles.", rich_help_panel=H),
        tensor_parallel: int = typer.Option(1, "--tensor_parallel", help="TP degree (run through `voodoo tp`).", rich_help_panel=H),
        device_map: Optional[str] = typer.Option(None, "--device_map", help="Layer-wise placement, e.g. cuda:0,cuda:1.", rich_help_panel=H),
        partial_save_interval: int = typer.Option(10, "--partial_save_interval", help="Write the journal every N steps.", rich_help_panel=J),
        resume: bool = typer.Option(True, "--resume/--no_resume", help="Resume from the journal in --output_dir if present.", rich_help_panel=J),
        dry_run: bool = typer.Option(False, "--dry_run", help="Print every tensor's menu, bytes and the size range; train nothing.", rich_help_panel=J),
        method: str = typer.Option("gates", "--method", help="gates: train the gates; sensitivity: greedy knapsack over the sensitivity table only (no training).", rich_help_panel=X),
        ptqr: bool = typer.Option(False, "--ptqr", help="Per-token routing: each token through one candidate sampled from the gates; straight-through gate gradient.", rich_help_panel=X),
        st_gumbel_fraction: float = typer.Option(0.0, "--st_gumbel_fraction", help="Last fraction of steps with straight-through Gumbel hardening (one candidate per tensor; exclusive with --ptqr).", rich_help_panel=X),
        st_gumbel_tau: float = typer.Option(0.5, "--st_gumbel_tau", help="Temperature of the straight-through Gumbel softmax.", rich_help_panel=X),
        warm_start: bool = typer.Option(True, "--warm_start/--no_warm_start", help="Start the gates on the sensitivity knapsack's layout (default: on); off: from a prior in bits around the target.", rich_help_panel=X),
        warm_start_mass: float = typer.Option(0.9, "--warm_start_mass", help="Probability of the layout's rung at step 0 under --warm_start.", rich_help_panel=X),
        sensitivity_sequences: int = typer.Option(4, "--sensitivity_sequences", help="Calibration sequences of the sensitivity table (first N of the tokens file).", rich_help_panel=X),
        sensitivity_kind: str = typer.Option("fisher", "--sensitivity_kind", help="Sensitivity table of the knapsack, warm start and polish: fisher (predicted ΔKL from the Fisher diagonal: how the error reaches the loss), measured (every rung's ΔKL measured with that one tensor quantized: one forward per tensor and rung, one process only) or output (each tensor's own imatrix-weighted output error).", rich_help_panel=X),
        polish: bool = typer.Option(True, "--polish/--no_polish", help="After the bake: one-rung moves ranked by sensitivity benefit per byte, inside the dead zone (default: on).", rich_help_panel=X),
        loss_chunk_size: int = typer.Option(1024, "--loss_chunk_size", help="Tokens per LM-head chunk of CE/KL (exact; 0: whole logits).", rich_help_panel=O),
        grad_accum_steps: int = typer.Option(1, "--grad_accum_steps", help="Micro-batches of --batch_size per optimizer step.", rich_help_panel=O),
        teacher_device: Optional[str] = typer.Option(None, "--teacher_device", help="Device of the teacher (default: --device), e.g. cpu.", rich_help_panel=H),
        log_file: Optional[str] = typer.Option(None, "--log_file", help="JSONL run log, one line per step (default: <output_dir>/train_log.jsonl).", rich_help_panel=J),
        finalize_from_partial: Optional[str] = typer.Option(None, "--finalize_from_partial", help="Redo only the bake from this journal (partial.pt); no training.", rich_help_panel=J),
        resume_from_partial: Optional[str] = typer.Option(None, "--resume_from_partial", help="Resume training from this journal instead of <output_dir>/partial.pt.", rich_help_panel=J),
        search_sequences: int = typer.Option(8, "--search_sequences", help="Training sequences held aside (the last N, at most a quarter of the file) on which the guarantee and the search measure KL(teacher ‖ baked student); 0: none (no guarantee, no search).", rich_help_panel=F),
        search_evals: int = typer.Option(0, "--search_evals", help="Measured-KL evaluations of a final local search from the guarantee's choice (one-rung moves and up/down pairs, ranked by the gates' gradient, kept only when the measured KL drops); 0 (the default): no search.", rich_help_panel=F),
        relaxation_gap: bool = typer.Option(False, "--relaxation_gap/--no_relaxation_gap", help="Add to the loss the KL the soft mixture hides from a one-hot file (½ Σ_k p_k (W_k − W̄)ᵀF(W_k − W̄), from the Fisher curvature): the gates then descend the expected KL of the file they bake.", rich_help_panel=O),
        search_confirm: int = typer.Option(0, "--search_confirm", help="More training sequences held aside (before the search's); the search's result is written only when its KL there is below its start's, else the start is (0, the default: no check).", rich_help_panel=F),
        search_margin: float = typer.Option(0.0, "--search_margin", help="Keep a search move only when the KL drop, paired over the held-aside sequences, exceeds this many standard errors (0: any drop).", rich_help_panel=F),
        guarantee: bool = typer.Option(True, "--guarantee/--no_guarantee", help="Measure the best uniform types, the stock llama-quantize recipes and both knapsacks that fit the budget beside the gates' bake, and write the best (or start the search from it).", rich_help_panel=F),
        error_compensation: str = typer.Option("auto", "--error_compensation", help="gptq: each tensor is handed to the same quantizer with every block's rounding error passed on to its later columns, from the layer inputs' Hessians on calibration text (stock llama-quantize writes the same types, not these bytes); none: every candidate quantizes the weights as they are (the bytes stock llama-quantize writes); auto: gptq (under --lazy from Hessians collected one decoder layer at a time: the same bytes), or none under tensor parallelism.", rich_help_panel=X),
        compensation_sequences: int = typer.Option(32, "--compensation_sequences", help="Calibration sequences of the Hessians under --error_compensation gptq (first N of the training tokens).", rich_help_panel=X),
        compensation_damp: float = typer.Option(0.1, "--compensation_damp", help="Damping of the Hessians: H + λ·mean(diag H)·I.", rich_help_panel=X),
        stock_references: Optional[List[str]] = typer.Option(None, "--stock_references", help="llama-quantize ftypes the guarantee considers (default: all; the largest three that fit are measured).", rich_help_panel=F),
    ) -> None:
        """Train the gates under the size budget, bake, and write the assignment."""
        # lazy: keeps `voodoo --help` light
        from ..training.report import print_dry_run, print_result, progress_reporter
        from ..distributed.parallel import launched_rank, leave, shutdown  # lazy: keeps `voodoo --help` light
        from ..training.setup import tiny  # lazy: keeps `voodoo --help` light
        from ..training.trainer import Trainer  # lazy: keeps `voodoo --help` light

        cfg = build_config(**{k: v for k, v in locals().items() if k in _FIELDS})
        try:
            if dry_run:  # from the config alone: no weights, no tokens file, no process group
                from ..memory.plan import dry_run as plan_dry_run  # lazy: keeps `voodoo --help` light

                if launched_rank() == 0:
                    print_dry_run(console, plan_dry_run(tiny(cfg)))
                return
            if cfg.tensor_parallel > 1 and launched_rank() > 0:  # rank 0 reports and writes; the others compute
                Trainer(cfg).train()
                leave()
            trainer = Trainer(cfg, progress=True)
            with progress_reporter(console, trainer) as (on_step, on_search):
                trainer.on_step = on_step
                trainer.on_search = on_search
                trainer.prepare()
                result = trainer.train()
            print_result(console, trainer.run, result)
            if cfg.tensor_parallel > 1:
                leave()  # after rank 0 has written and reported
        finally:
            if cfg.tensor_parallel > 1:
                shutdown()


_FIELDS = {
    "model", "base_checkpoint", "text_model_class", "teacher_quant", "teacher_checkpoint", "compression_ratio",
    "target_bits", "budget_reduction", "tensor_upgrades", "size_weight", "size_tolerance", "candidate_types",
    "attention_candidates", "non_attention_candidates", "fill_menus", "imatrix", "seq_len", "batch_size", "max_steps", "lr",
    "distill_weight", "tau_start", "tau_end", "seed", "data_dir", "data_name", "output_dir", "output_name", "device",
    "dtype", "lazy", "gradient_checkpointing", "no_compile", "tensor_parallel", "device_map", "partial_save_interval",
    "resume", "dry_run", "method", "ptqr", "st_gumbel_fraction", "st_gumbel_tau", "warm_start", "warm_start_mass",
    "sensitivity_sequences", "polish", "loss_chunk_size", "grad_accum_steps", "teacher_device", "log_file",
    "finalize_from_partial", "resume_from_partial", "search_sequences", "search_evals", "search_confirm", "search_margin", "relaxation_gap", "guarantee", "stock_references", "sensitivity_kind",
    "error_compensation", "compensation_sequences", "compensation_damp",
}
