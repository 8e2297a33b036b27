"""`voodoo eval`: torch numbers equal a direct computation; GGUF numbers are llama-perplexity's."""

from __future__ import annotations

import json
import math
import subprocess

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import paths
from voodoo_quant.tools.embedded import shakespeare_dir
from voodoo_quant.tools.evaluate import (
    GGUFEvalConfig, chunk_klds, chunk_stderr, evaluate_ggufs, evaluate_torch, median, percentile, stderr,
)

runner = CliRunner()


def _tiny(seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=97, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=2, num_key_value_heads=1, head_dim=16, max_position_embeddings=64)
    return LlamaForCausalLM(cfg).eval()


def test_percentile_is_llama_perplexity_definition():
    v = sorted(np.random.default_rng(0).random(1001).tolist())
    for f in (0.5, 0.9, 0.99, 0.999):
        assert percentile(v, f) == pytest.approx(float(np.percentile(v, 100 * f)), rel=1e-6)
    assert median([1.0, 2.0, 4.0, 8.0]) == 3.0 and median([1.0, 5.0, 9.0]) == 5.0


def test_torch_eval_equals_direct_computation():
    student, teacher = _tiny(0), _tiny(1)
    tokens = torch.randint(0, 97, (3, 20), generator=torch.Generator().manual_seed(2))
    row = evaluate_torch(student, tokens, teacher=teacher, batch_size=2)

    nll, kld, same = [], [], []
    with torch.no_grad():
        for seq in tokens:
            s = student(seq[None]).logits[0].double()
            t = teacher(seq[None]).logits[0].double()
            for i in range(len(seq) - 1):  # position i predicts token i+1
                ps, pt = torch.softmax(s[i], -1), torch.softmax(t[i], -1)
                nll.append(-math.log(ps[seq[i + 1]].item()))
                kld.append(float((pt * (pt.log() - ps.log())).sum()))
                same.append(int(ps.argmax() == pt.argmax()))
    k = np.sort(np.array(kld))
    assert row.tokens == 3 * 19
    assert row.ppl == pytest.approx(math.exp(np.mean(nll)), rel=1e-9)
    assert row.kld_mean == pytest.approx(np.mean(kld), rel=1e-9)
    assert row.kld_median == pytest.approx(np.median(k), rel=1e-9)
    assert row.kld_p99 == pytest.approx(np.percentile(k, 99), rel=1e-9)
    assert row.kld_p999 == pytest.approx(np.percentile(k, 99.9), rel=1e-9)
    assert row.same_top_p == pytest.approx(100 * np.mean(same), rel=1e-12)
    assert row.kld_mean > 0
    # teacher logits give the same numbers as the teacher module; a model against itself gives 0
    with torch.no_grad():
        logits = teacher(tokens).logits
    row2 = evaluate_torch(student, tokens, teacher_logits=logits, batch_size=3)
    assert row2.kld_mean == pytest.approx(row.kld_mean, rel=1e-6) and row2.ppl == row.ppl
    self_row = evaluate_torch(student, tokens, teacher=student)
    assert self_row.kld_mean == pytest.approx(0.0, abs=1e-12) and self_row.same_top_p == 100.0


def test_cli_errors_are_one_line(tmp_path):
    r = runner.invoke(app, ["eval", "--gguf", str(tmp_path / "a.gguf")])
    assert r.exit_code != 0 and r.stderr.strip().startswith("error: ") and "--reference" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1
    r = runner.invoke(app, ["eval"])
    assert r.exit_code != 0 and "nothing to evaluate" in r.stderr


def _stat(text: str, label: str) -> float:
    """Independent reading of one llama-perplexity statistics line: 'label: value [± unc]'."""
    for line in text.splitlines():
        if line.startswith(label):
            return float(line.split(":", 1)[1].split("±")[0].strip().rstrip("%"))
    raise AssertionError(f"no line {label!r}")


@pytest.mark.slow
def test_gguf_eval_parses_real_llama_perplexity(tiny_llama_f32_gguf, tmp_path):
    q8, q4 = tmp_path / "tiny-q8_0.gguf", tmp_path / "tiny-q4_0.gguf"
    for f, q in ((q8, "Q8_0"), (q4, "Q4_0")):
        p = subprocess.run([str(paths.tool_path("llama-quantize")), str(tiny_llama_f32_gguf), str(f), q, "2"],
                           capture_output=True, text=True)
        assert p.returncode == 0, p.stderr[-1000:]
    text = tmp_path / "text.txt"
    text.write_text(sorted(shakespeare_dir().rglob("*.md"))[0].read_text(encoding="utf-8")[:20000])
    work = tmp_path / "work"
    cfg = GGUFEvalConfig(files=[q8, q4], reference=tiny_llama_f32_gguf, text=text, ctx=64, chunks=4, workers=2,
                         output_json=tmp_path / "e.json", plot=tmp_path / "e.png", work_dir=work)
    res = evaluate_ggufs(cfg, progress=False)
    row = res["rows"][0]
    # llama-perplexity by hand, on the same base log-probs
    p = subprocess.run([str(paths.tool_path("llama-perplexity")), "-m", str(q8), "--kl-divergence-base",
                        str(work / "base.kld"), "--kl-divergence", "-c", "64", "--chunks", "4", "-t", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-1000:]
    out = p.stdout + p.stderr
    assert row["kld_mean"] == _stat(out, "Mean    KLD")
    assert row["kld_median"] == _stat(out, "Median  KLD")
    assert row["kld_p99"] == _stat(out, "99.0%   KLD")
    assert row["kld_p999"] == _stat(out, "99.9%   KLD")
    assert row["same_top_p"] == _stat(out, "Same top p")
    assert row["ppl"] == _stat(out, "Mean PPL(Q)")
    assert 0 < row["kld_mean"] < 0.1 and row["size_bytes"] == q8.stat().st_size
    assert 8.4 < row["bpw"] < 8.6  # Q8_0 = 8.5 bpw; 1-D norms stay F32
    # The noise of the mean: one KLD per chunk from the running table, whose mean is the mean KLD
    # (the last running mean has 5 decimals, the statistic 6). This random model's KLDs are too
    # small for the table's 5 decimals to resolve their spread (Q8_0's print as 0.00000): no
    # standard error, rather than a rounding artefact; test_chunk_klds_... covers a resolved one.
    assert len(chunk_klds(out)) == 4 and row["kld_stderr"] is None
    p = subprocess.run([str(paths.tool_path("llama-perplexity")), "-m", str(q4), "--kl-divergence-base",
                        str(work / "base.kld"), "--kl-divergence", "-c", "64", "--chunks", "4", "-t", "2"],
                       capture_output=True, text=True)
    chunks, row4 = chunk_klds(p.stdout + p.stderr), res["rows"][1]
    assert len(chunks) == 4 and all(c > 0 for c in chunks)
    assert abs(sum(chunks) / 4 - row4["kld_mean"]) < 1e-5
    assert row4["kld_stderr"] == chunk_stderr(chunks)
    assert json.loads((tmp_path / "e.json").read_text())["rows"][0]["kld_mean"] == row["kld_mean"]
    assert (tmp_path / "e.png").read_bytes()[:4] == b"\x89PNG"


def test_unreadable_ggufs_are_refused_by_name_before_llama_perplexity(tiny_llama_f32_gguf, tmp_path):
    """Every GGUF input is parsed first: a random file, a truncated one and a bad reference are
    refused in one line naming the file (llama-perplexity alone may say only 'exited with 1')."""
    rng = np.random.default_rng(0)
    rand = tmp_path / "random.gguf"
    rand.write_bytes(rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    garbage = tmp_path / "garbage.gguf"
    garbage.write_bytes(b"GGUF" + rng.integers(0, 256, 4096, dtype=np.uint8).tobytes())
    cut = tmp_path / "cut.gguf"
    cut.write_bytes(tiny_llama_f32_gguf.read_bytes()[:-1000])
    text = tmp_path / "t.txt"
    text.write_text("some text " * 50)
    cases = [(["--gguf", rand, "--reference", tiny_llama_f32_gguf], f"--gguf file {rand} is not a GGUF file"),
             (["--gguf", garbage, "--reference", tiny_llama_f32_gguf], f"--gguf file {garbage} "),
             (["--gguf", cut, "--reference", tiny_llama_f32_gguf], f"--gguf file {cut} is truncated: tensor "),
             (["--gguf", tiny_llama_f32_gguf, "--reference", rand], f"--reference GGUF {rand} is not a GGUF file")]
    for args, expect in cases:
        r = runner.invoke(app, ["eval", *map(str, args), "--text", str(text)])
        lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
        assert r.exit_code != 0 and len(lines) == 1 and lines[0].startswith("error: "), r.stderr
        assert expect in lines[0] and "llama-perplexity" not in lines[0], lines[0]


def test_chunk_klds_undo_the_running_means():
    text = "\n".join([
        "chunk             PPL               ln(PPL(Q)/PPL(base))          KL Divergence              Δp RMS            Same top p",
        "   1      27.1000 ±    1.2000       0.01000 ±    0.00100       0.02000 ±    0.00100     3.000 ±  0.100 %    91.000 ±  1.000 %",
        "   2      27.3000 ±    1.1000       0.01200 ±    0.00100       0.03000 ±    0.00100     3.100 ±  0.100 %    90.000 ±  1.000 %",
        "   3      27.2000 ±    1.0000       0.01100 ±    0.00100       0.02000 ±    0.00100     3.000 ±  0.100 %    91.000 ±  1.000 %",
    ])
    xs = chunk_klds(text)
    assert xs == pytest.approx([0.02, 0.04, 0.0])
    assert stderr(xs) == pytest.approx(0.02 / math.sqrt(3))
    assert stderr(xs[:1]) is None and chunk_klds("no table") == []
    assert chunk_stderr(xs) == stderr(xs)  # resolved
    assert chunk_stderr([0.0, 0.00001, 0.0, 0.00001]) is None  # within the table's rounding
