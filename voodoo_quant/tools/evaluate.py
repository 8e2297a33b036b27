"""`voodoo eval`: perplexity and KL(teacher ‖ student), in torch and for GGUFs in stock llama.cpp.

Torch: every position of every ``eval_tokens.pt`` sequence that predicts a next token is scored
(``seq_len - 1`` per sequence). The student and teacher are already-built ``nn.Module`` s (or
teacher logits), so the trainer's student — built from a trained ``.pt`` or an assignment — plugs
in directly. Percentiles use llama-perplexity's definition (linear interpolation between sorted
values, ``tools/perplexity/perplexity.cpp`` ``percentile``; median = mean of the middle two).

GGUF: stock ``llama-perplexity``. The reference model's log-probs are computed once
(``--kl-divergence-base``), then each file runs with ``--kl-divergence`` and its report is parsed.
``-c`` (``ctx``): the text is cut into non-overlapping chunks of ``ctx`` tokens and only the second
half of each chunk is scored (``first = n_ctx/2`` in perplexity.cpp), so each chunk gives
``ctx - 1 - ctx/2`` tokens; KLD statistics are printed only from 100 tokens on, and the text must
hold at least ``2·ctx`` tokens. ``chunks`` caps the number of chunks (default: all).
"""

from __future__ import annotations

import math
import re
import tempfile
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Sequence

from ..core import envs, fileio
from ..core.errors import ConfigError, ToolFailedError
from ..model import modeling
from ..model.checkpoints import module_from_checkpoint
from ..model.modeling import load_tokenizer
from .data import load_tokens
from .llama_tools import check_gguf, gguf_tensor_stats, last_error_line, run_tool

# -- statistics --------------------------------------------------------------------------------


def percentile(sorted_values: Sequence[float], fraction: float) -> float:
    """perplexity.cpp's percentile of an ascending list."""
    v = sorted_values
    if fraction <= 0:
        return float(v[0])
    if fraction >= 1:
        return float(v[-1])
    p = fraction * (len(v) - 1)
    ip = int(p)
    p -= ip
    return float((1 - p) * v[ip] + p * v[min(ip + 1, len(v) - 1)])


def median(sorted_values: Sequence[float]) -> float:
    n = len(sorted_values)
    return float(sorted_values[n // 2] if n % 2 else 0.5 * (sorted_values[n // 2] + sorted_values[n // 2 - 1]))


@dataclass
class EvalRow:
    """One model's numbers; the same fields for torch and GGUF evaluation (None = not measured)."""

    name: str
    ppl: float
    kld_mean: float | None = None
    kld_median: float | None = None
    kld_p99: float | None = None
    kld_p999: float | None = None
    kld_max: float | None = None
    same_top_p: float | None = None  # percent
    ppl_base: float | None = None
    size_bytes: int | None = None
    bpw: float | None = None
    tokens: int | None = None
    # Standard error of kld_mean over llama-perplexity's chunks (each scores the same number of
    # tokens, so kld_mean is their mean): the noise of the mean. None = fewer than 2 chunks, or torch.
    kld_stderr: float | None = None


# -- torch -------------------------------------------------------------------------------------


def token_stats(student_logits, targets, teacher_logits=None) -> dict[str, Any]:
    """Per-token NLL of the student, and KL(teacher‖student) + same-top-1 when a teacher is given.

    `student_logits`/`teacher_logits`: ``[n, T, V]`` logits at the positions that predict
    `targets` ``[n, T]``. Computed in float64 so that the result is a reference, not a guess.
    """
    import torch

    ls = torch.log_softmax(student_logits.double(), dim=-1)
    out = {"nll": -ls.gather(-1, targets.unsqueeze(-1)).squeeze(-1).reshape(-1)}
    if teacher_logits is not None:
        lt = torch.log_softmax(teacher_logits.double(), dim=-1)
        out["kld"] = (lt.exp() * (lt - ls)).sum(-1).reshape(-1)
        out["same_top"] = (lt.argmax(-1) == ls.argmax(-1)).reshape(-1)
    return out


def summarize(name: str, nll, kld=None, same_top=None) -> EvalRow:
    row = EvalRow(name=name, ppl=float(math.exp(float(nll.mean()))), tokens=int(nll.numel()))
    if kld is not None:
        k = sorted(kld.tolist())
        row.kld_mean = float(kld.mean())
        row.kld_median = median(k)
        row.kld_p99 = percentile(k, 0.99)
        row.kld_p999 = percentile(k, 0.999)
        row.kld_max = float(k[-1])
        row.same_top_p = 100.0 * float(same_top.double().mean())
    return row


def evaluate_torch(student, tokens, *, teacher=None, teacher_logits=None, name: str = "student",
                   batch_size: int = 1, device: str = "cpu") -> EvalRow:
    """PPL of `student` on `tokens` ``[n, seq_len]``, and KL against `teacher` (a module) or
    `teacher_logits` (``[n, seq_len, V]``, the teacher's logits on the same tokens)."""
    import torch

    if teacher is not None and teacher_logits is not None:
        raise ConfigError("give a teacher module or teacher logits, not both")
    if batch_size < 1:
        raise ConfigError(f"batch_size must be >= 1, got {batch_size}")
    parts: dict[str, list] = {"nll": [], "kld": [], "same_top": []}
    teacher_ppl_nll = []
    with torch.no_grad():
        for i in range(0, tokens.shape[0], batch_size):
            x = tokens[i:i + batch_size].to(device)
            s = student(x).logits[:, :-1].float()
            t = None
            if teacher is not None:
                t = teacher(x).logits[:, :-1].float()
            elif teacher_logits is not None:
                t = teacher_logits[i:i + batch_size, :-1].to(device).float()
            st = token_stats(s, x[:, 1:], t)
            for k, v in st.items():
                parts[k].append(v.cpu())
            if t is not None:
                teacher_ppl_nll.append(token_stats(t, x[:, 1:])["nll"].cpu())
    cat = {k: torch.cat(v) if v else None for k, v in parts.items()}
    row = summarize(name, cat["nll"], cat["kld"], cat["same_top"])
    if teacher_ppl_nll:
        row.ppl_base = float(math.exp(float(torch.cat(teacher_ppl_nll).mean())))
    return row


# -- GGUF through llama-perplexity -------------------------------------------------------------

_NUM = r"([-+]?[0-9]*\.?[0-9]+(?:[eE][-+]?[0-9]+)?|nan|inf|-inf)"
_PATTERNS = {
    "ppl": rf"^Mean PPL\(Q\)\s*:\s*{_NUM}",
    "ppl_base": rf"^Mean PPL\(base\)\s*:\s*{_NUM}",
    "kld_mean": rf"^Mean\s+KLD:\s*{_NUM}",
    "kld_max": rf"^Maximum KLD:\s*{_NUM}",
    "kld_p999": rf"^99\.9%\s+KLD:\s*{_NUM}",
    "kld_p99": rf"^99\.0%\s+KLD:\s*{_NUM}",
    "kld_median": rf"^Median\s+KLD:\s*{_NUM}",
    "same_top_p": rf"^Same top p:\s*{_NUM}",
}


# A row of the running table: chunk, PPL ± e, ln(PPL ratio) ± e, KL divergence ± e, ...
_CHUNK_ROW = re.compile(r"^\s*(\d+)\s+[-\d.]+\s*±\s*[-\d.]+\s+[-\d.]+\s*±\s*[-\d.]+\s+([-\d.]+)\s*±", re.MULTILINE)


def chunk_klds(text: str) -> list[float]:
    """Each chunk's own mean KLD, from ``llama-perplexity --kl-divergence``'s running table (the
    row of chunk i prints the mean over chunks 1..i): x_i = i·m_i − (i−1)·m_(i−1). The table has
    5 decimals, so x_i carries a rounding error of about 1e-5·i: over 32 chunks it adds 1.3e-5 in
    quadrature to the standard error (under 1 % of one of 1e-4; `chunk_stderr` says when it dominates)."""
    means: dict[int, float] = {}
    for m in _CHUNK_ROW.finditer(text):
        means[int(m.group(1))] = float(m.group(2))
    out, prev = [], 0.0
    for i in range(1, len(means) + 1):
        if i not in means:
            break
        out.append(i * means[i] - (i - 1) * prev)
        prev = means[i]
    return out


def stderr(values: Sequence[float]) -> float | None:
    """Standard error of the mean of `values` (None for fewer than two)."""
    if len(values) < 2:
        return None
    mean = math.fsum(values) / len(values)
    return math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (len(values) - 1) / len(values))


def chunk_stderr(chunks: Sequence[float]) -> float | None:
    """Standard error of the mean KLD over chunks (`chunk_klds`), or None where the table's 5
    decimals cannot resolve it: when it is under twice what their rounding alone would give
    (a near-lossless file's per-chunk KLDs print as 0.00000)."""
    se = stderr(chunks)
    if se is None:
        return None
    n = len(chunks)
    rounding = math.sqrt(sum((i * i + (i - 1) ** 2) for i in range(1, n + 1)) / n * (1e-5 ** 2 / 12) / n)
    return se if se >= 2 * rounding else None


def parse_kld_report(text: str) -> dict[str, float | None]:
    """The statistics block that ``llama-perplexity --kl-divergence`` prints at its end, and the
    standard error of its mean KLD over chunks (``kld_stderr``). Its own "± x" after the mean is
    the per-token standard error, which ignores that neighbouring tokens' KLDs are correlated:
    smaller than the chunk one (0.00021 against 0.00049 for SmolLM2 Voodoo80, 32 chunks), so it is not used."""
    out: dict[str, float | None] = {}
    for key, pat in _PATTERNS.items():
        m = re.search(pat, text, re.MULTILINE)
        if m is None:
            raise ToolFailedError(
                f"llama-perplexity printed no {key} statistic ({last_error_line(text)}); the text may be too "
                "short for KL statistics (>= 100 scored tokens needed): lower -c or give more text"
            )
        out[key] = float(m.group(1))
    out["kld_stderr"] = chunk_stderr(chunk_klds(text))
    return out


def parse_final_ppl(text: str) -> float:
    m = re.search(rf"Final estimate: PPL = {_NUM}", text)
    if m is None:
        # llama-perplexity exits 0 on some failures (e.g. an unwritable --kl-divergence-base)
        raise ToolFailedError(f"llama-perplexity printed no 'Final estimate: PPL' line: {last_error_line(text)}")
    return float(m.group(1))


@dataclass
class GGUFEvalConfig:
    files: list[Path]
    reference: Path  # the model whose logits are the base (e.g. the F16/F32 teacher GGUF)
    text: Path | None = None  # raw text for llama-perplexity -f
    eval_tokens: Path | None = None  # or eval_tokens.pt, detokenized with `tokenizer`
    tokenizer: str | None = None  # tokenizer source for eval_tokens (default: the reference GGUF)
    ctx: int = 512
    chunks: int | None = None
    workers: int | None = None  # llama-perplexity -t; default VOODOO_QUANT_WORKERS
    output_json: Path | None = None
    plot: Path | None = None
    work_dir: Path | None = None  # where the base log-probs go (default: a temp dir)

    def __post_init__(self) -> None:
        self.files = [Path(f) for f in self.files]
        self.reference = Path(self.reference)
        if not self.files:
            raise ConfigError("no --gguf files to evaluate")
        for f in [self.reference, *self.files]:
            if not f.is_file():
                raise ConfigError(f"GGUF file {f} does not exist")
        # Parsed before any stock tool runs: llama-perplexity may fail on a bad file naming none.
        check_gguf(self.reference, "--reference GGUF")
        for f in self.files:
            check_gguf(f, "--gguf file")
        if (self.text is None) == (self.eval_tokens is None):
            raise ConfigError("give exactly one of --text FILE and --eval_tokens FILE")
        if self.text is not None and not Path(self.text).is_file():
            raise ConfigError(f"--text {self.text} does not exist")
        if self.ctx < 8 or self.ctx % 2:
            raise ConfigError(f"-c/--ctx must be an even number >= 8, got {self.ctx}")
        if self.chunks is not None and self.chunks < 1:
            raise ConfigError(f"--chunks must be >= 1, got {self.chunks}")


def detokenize(eval_tokens: Path, tokenizer_source: str | Path, out: Path) -> Path:
    """eval_tokens.pt as raw text for ``llama-perplexity -f`` (it tokenizes it again itself)."""
    tokens = load_tokens(eval_tokens, what="eval tokens")
    tok = load_tokenizer(tokenizer_source)
    return fileio.write_text(out, tok.decode(tokens.reshape(-1).tolist()))


def perplexity_args(ctx: int, chunks: int | None, threads: int | None) -> list[str]:
    """``-c``, ``-t`` and ``--chunks`` of every llama-perplexity run of one evaluation."""
    args = ["-c", str(ctx), "-t", str(threads or envs.quant_workers())]
    return args + (["--chunks", str(chunks)] if chunks is not None else [])


def kld_base(reference: Path, text: Path, base: Path, args: Sequence[str]) -> float:
    """The reference's log-probs on `text`, written atomically to `base`
    (``--kl-divergence-base``); returns the reference's PPL."""
    out: dict[str, str] = {}
    fileio.write_with(base, lambda tmp: out.update(text=run_tool(
        "llama-perplexity", ["-m", reference, "-f", text, "--kl-divergence-base", tmp, *args]).output))
    return parse_final_ppl(out["text"])


def kld_file(f: Path, base: Path, args: Sequence[str]) -> tuple[EvalRow, list[float]]:
    """One GGUF against the base log-probs: its row, and each chunk's mean KLD (:func:`chunk_klds`:
    what a paired comparison of two files on the same chunks needs)."""
    run = run_tool("llama-perplexity", ["-m", f, "--kl-divergence-base", base, "--kl-divergence", *args])
    data_bytes, n_weights = gguf_tensor_stats(f)
    row = EvalRow(name=f.name, size_bytes=f.stat().st_size, bpw=8.0 * data_bytes / n_weights,
                  **parse_kld_report(run.output))
    return row, chunk_klds(run.output)


def evaluate_ggufs(cfg: GGUFEvalConfig, progress: bool = True) -> dict[str, Any]:
    from rich.progress import Progress

    with tempfile.TemporaryDirectory(prefix="voodoo-eval-") as tmp:
        work = Path(cfg.work_dir) if cfg.work_dir else Path(tmp)
        work.mkdir(parents=True, exist_ok=True)
        text = Path(cfg.text) if cfg.text else detokenize(cfg.eval_tokens, cfg.tokenizer or cfg.reference, work / "eval_text.txt")
        base = work / "base.kld"
        rows: list[EvalRow] = []
        with Progress(disable=not progress, transient=True) as bar:
            task = bar.add_task("llama-perplexity", total=len(cfg.files) + 1)
            args = perplexity_args(cfg.ctx, cfg.chunks, cfg.workers)
            ref_ppl = kld_base(cfg.reference, text, base, args)
            bar.advance(task)
            for f in cfg.files:
                rows.append(kld_file(f, base, args)[0])
                bar.advance(task)
    result = {
        "reference": {"file": str(cfg.reference), "ppl": ref_ppl},
        "text": str(cfg.text or cfg.eval_tokens),
        "ctx": cfg.ctx,
        "chunks": cfg.chunks,
        "rows": [asdict(r) | {"file": str(f)} for r, f in zip(rows, cfg.files)],
    }
    if cfg.output_json is not None:
        fileio.write_json(cfg.output_json, result)
    if cfg.plot is not None:
        plot_pareto(rows, cfg.plot)
    return result


def plot_pareto(rows: Sequence[EvalRow], out: Path) -> Path:
    """Mean KLD (log scale) against file size, one labelled point per file."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4.5))
    for r in rows:
        x, y = r.size_bytes / 1e6, max(r.kld_mean or 0.0, 1e-6)
        ax.scatter([x], [y])
        ax.annotate(r.name, (x, y), fontsize=7, xytext=(3, 3), textcoords="offset points")
    ax.set_yscale("log")
    ax.set_xlabel("file size (MB)")
    ax.set_ylabel("mean KLD vs reference (log)")
    ax.grid(True, which="both", alpha=0.3)
    fig.tight_layout()
    fileio.write_with(out, lambda p: fig.savefig(p, format="png", dpi=120))
    plt.close(fig)
    return Path(out)


@dataclass
class TorchEvalConfig:
    model: str  # the student: HF dir / GGUF / base .pt
    eval_tokens: Path
    teacher_checkpoint: Path | None = None  # a voodoo teacher .pt (Q8_0)
    batch_size: int = 1
    max_sequences: int | None = None
    device: str = "cpu"
    output_json: Path | None = None
    extra: dict[str, Any] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.batch_size < 1:
            raise ConfigError(f"--batch_size must be >= 1, got {self.batch_size}")
        if self.max_sequences is not None and self.max_sequences < 1:
            raise ConfigError(f"--max_sequences must be >= 1, got {self.max_sequences}")
        if not Path(self.eval_tokens).is_file():
            raise ConfigError(f"--eval_tokens {self.eval_tokens} does not exist")


def evaluate_torch_cli(cfg: TorchEvalConfig) -> EvalRow:
    """The CLI's torch path: student from ``--model``, teacher from ``--teacher_checkpoint``."""
    tokens = load_tokens(cfg.eval_tokens, what="eval tokens")
    if cfg.max_sequences:
        tokens = tokens[: cfg.max_sequences]
    if str(cfg.model).endswith(".pt"):
        student = module_from_checkpoint(cfg.model)
    else:
        student = modeling.load_model(cfg.model)
    teacher = module_from_checkpoint(cfg.teacher_checkpoint) if cfg.teacher_checkpoint else None
    row = evaluate_torch(student.to(cfg.device), tokens, teacher=None if teacher is None else teacher.to(cfg.device),
                         name=Path(cfg.model).name, batch_size=cfg.batch_size, device=cfg.device)
    if cfg.output_json is not None:
        fileio.write_json(cfg.output_json, {"eval_tokens": str(cfg.eval_tokens), "rows": [asdict(row)]})
    return row
