"""The exactness contract end to end: train a few steps, export, and check that

1. every selected tensor's bytes in the GGUF are the candidate-cache entry its training candidate
   was dequantized from, and equal stock ``llama-quantize --tensor-type-file`` with the same
   imatrix, tensor for tensor (every tensor of the file, not only the selected ones);
2. export refuses, in one line naming both values, what the assignment was not trained with:
   another imatrix, a vanished imatrix, other base weights, another libggml, a hand-edited type,
   an assignment that records no provenance; ``--allow_mismatch`` exports anyway.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess

import numpy as np
import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import paths
from voodoo_quant.core import qtypes as qt
from voodoo_quant.gguf import converter
from voodoo_quant.selection.assignment import Assignment
from voodoo_quant.training import provenance

MENU = ("Q8_0", "Q6_K", "Q4_K", "Q3_K", "Q2_K")  # K-quants: their bytes depend on the imatrix


@pytest.fixture(scope="module")
def trained(imatrix_llama256_hf_dir, synthetic_run_inputs, tmp_path_factory):
    from voodoo_quant.gguf.imatrix import Entry, Imatrix
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    d = imatrix_llama256_hf_dir
    root = tmp_path_factory.mktemp("contract")
    entries = synthetic_run_inputs(d, root)
    other = dict(entries)
    name0 = sorted(other)[0]
    other[name0] = Entry(sums=other[name0].sums * 2.0, counts=np.array([37]))
    Imatrix(entries=other, datasets=["synthetic"], chunk_count=3, chunk_size=512).save_gguf(root / "other-imatrix.gguf")
    cfg = TrainConfig(model=str(d), data_dir=str(root / "data"), imatrix=str(root / "imatrix.gguf"), seq_len=32,
                      batch_size=2, max_steps=3, compression_ratio=0.55, candidate_types=MENU,
                      output_dir=str(root / "run"), error_compensation="none")  # plain: stock llama-quantize's bytes
    tr = Trainer(cfg)
    res = tr.train()
    return root, d, tr, res


def _tensors(path):
    return {t.name: t for t in converter.vendored_gguf().GGUFReader(path).tensors}


def _raw(t) -> bytes:
    return np.asarray(t.data).view(np.uint8).tobytes()


def _export_cli(*args):
    return CliRunner().invoke(app, ["export", *map(str, args)])


def _one_line_error(r, *must: str) -> str:
    assert r.exit_code != 0, r.output
    lines = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), r.stderr
    for m in must:
        assert m in lines[0], (m, lines[0])
    print(lines[0])  # shown with -s: the refusal exactly as a user reads it
    return lines[0]


def test_training_records_what_produced_the_assignment(trained):
    root, d, tr, res = trained
    asg = Assignment.load(root / "run" / "assignment.json")
    assert asg.format_version == 2 and not asg.missing_provenance()
    assert asg.imatrix == str((root / "imatrix.gguf").resolve())
    from voodoo_quant.core.fileio import sha256_file

    assert asg.imatrix_sha256 == sha256_file(root / "imatrix.gguf")
    assert asg.ggml_version == provenance.ggml_version()
    assert asg.menus == {"attention": list(MENU), "other": list(MENU)}
    # The weights hash is the one of the float weights, independent of training: a stamp of the
    # same assignment from the checkpoint on disk gives it again.
    assert provenance.stamp(asg, d, imatrix=root / "imatrix.gguf").weights_sha256 == asg.weights_sha256


@pytest.mark.slow
def test_exported_bytes_are_the_training_candidates_and_stock_llama_quantize(trained):
    from voodoo_quant.candidates.cache import CandidateCache
    from voodoo_quant.gguf.imatrix import load
    from voodoo_quant.model.modeling import load_model
    from voodoo_quant.student.build import selectable_weights
    from voodoo_quant.tools.export import ExportConfig, export

    root, d, tr, res = trained
    asg = res.assignment
    assert len(set(asg.type_counts())) >= 2, asg.type_counts()  # a real mix, not one uniform type
    # No --imatrix: export takes the one the assignment records.
    out = export(ExportConfig(model=d, assignment=root / "run" / "assignment.json", output_dir=root / "out",
                              output_name="tiny.gguf", keep_f32=True))
    assert out.imatrix == asg.imatrix and not out.fixed
    ours = _tensors(out.path)
    kv = converter.vendored_gguf().GGUFReader(out.path).fields
    assert kv["quantize.imatrix.file"].contents() == asg.imatrix[:127]

    # (1) every selected tensor = the cache entry of its training candidate
    imx = load(root / "imatrix.gguf")
    weights = {n: w for n, (w, _) in selectable_weights(load_model(str(d), dtype=torch.float32)).items()}
    cache = CandidateCache()
    plans = {p.name: p for p in tr.run.plans}
    assert set(plans) == set(asg.tensors)
    for name, c in asg.tensors.items():
        p = plans[name]
        vec = None if qt.get(c.qtype).is_float else imx.get_vector(p.gguf_name, p.n_per_row)
        assert vec is not None  # the imatrix covers every tensor: K-quant bytes depend on it
        cand = cache.get(CandidateCache.key(p.layout.to_gguf(weights[name]), c.qtype, vec))
        assert cand is not None, f"{name}: no cache entry for its {c.qtype} candidate"
        t = ours[c.gguf_name]
        assert t.tensor_type.name == c.qtype
        assert _raw(t) == cand, f"{name}: exported {c.qtype} bytes differ from the training candidate"

    # (2) the whole file = stock llama-quantize with our tensor-type file and the same imatrix
    stock = root / "stock.gguf"
    p = subprocess.run([str(paths.tool_path("llama-quantize")), "--tensor-type-file", str(out.tensor_type_file),
                        "--imatrix", str(root / "imatrix.gguf"), str(out.f32_gguf), str(stock), "Q8_0", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    theirs = _tensors(stock)
    assert sorted(ours) == sorted(theirs)
    diff = [n for n in ours if ours[n].tensor_type != theirs[n].tensor_type or _raw(ours[n]) != _raw(theirs[n])]
    assert not diff, f"{len(diff)} tensor(s) differ from llama-quantize, e.g. {diff[:3]}"


def test_export_refuses_another_imatrix_naming_both(trained, tmp_path):
    root, d, _, res = trained
    from voodoo_quant.core.fileio import sha256_file

    line = _one_line_error(
        _export_cli("--model", d, "--assignment", root / "run" / "assignment.json", "--output_dir", tmp_path,
                    "--output_name", "x.gguf", "--imatrix", root / "other-imatrix.gguf"),
        "imatrix mismatch", res.assignment.imatrix_sha256, sha256_file(root / "other-imatrix.gguf"), "--allow_mismatch")
    assert not list(tmp_path.iterdir()), line  # refused before anything was written


def test_export_refuses_when_the_recorded_imatrix_is_gone(trained, tmp_path):
    root, d, _, res = trained
    asg = json.loads((root / "run" / "assignment.json").read_text())
    asg["imatrix"] = str(tmp_path / "moved-away.gguf")
    (tmp_path / "a.json").write_text(json.dumps(asg))
    _one_line_error(_export_cli("--model", d, "--assignment", tmp_path / "a.json", "--output_dir", tmp_path / "o",
                                "--output_name", "x.gguf"),
                    "imatrix missing", str(tmp_path / "moved-away.gguf"), asg["imatrix_sha256"])


def test_export_refuses_another_libggml_and_a_hand_edited_type(trained, tmp_path):
    root, d, _, _ = trained
    asg = json.loads((root / "run" / "assignment.json").read_text())
    asg["ggml_version"] = "ggml 0.0.1 (commit deadbeef)"
    (tmp_path / "g.json").write_text(json.dumps(asg))
    _one_line_error(_export_cli("--model", d, "--assignment", tmp_path / "g.json", "--output_dir", tmp_path / "o",
                                "--output_name", "x.gguf"),
                    "libggml mismatch", "ggml 0.0.1 (commit deadbeef)", provenance.ggml_version())

    # A hand-edited type: its recorded bytes no longer match what the type gives the tensor.
    asg = json.loads((root / "run" / "assignment.json").read_text())
    name, c = sorted(asg["tensors"].items())[0]
    new = next(t for t in ("Q5_0", "Q8_0") if qt.tensor_bytes(t, c["shape"]) != c["nbytes"])
    asg["tensors"][name]["qtype"] = new
    (tmp_path / "m.json").write_text(json.dumps(asg))
    _one_line_error(_export_cli("--model", d, "--assignment", tmp_path / "m.json", "--output_dir", tmp_path / "o",
                                "--output_name", "x.gguf"), name, f"{c['nbytes']:,} bytes for {new}")


def test_export_refuses_an_assignment_without_provenance(trained, tmp_path):
    root, d, _, _ = trained
    asg = json.loads((root / "run" / "assignment.json").read_text())
    for k in ("weights_sha256", "ggml_version", "menus", "base_checkpoint"):
        del asg[k]
    asg["format_version"] = 1
    (tmp_path / "old.json").write_text(json.dumps(asg))
    _one_line_error(_export_cli("--model", d, "--assignment", tmp_path / "old.json", "--output_dir", tmp_path / "o",
                                "--output_name", "x.gguf"),
                    "format 1", "weights_sha256, ggml_version, menus", "--allow_mismatch")


def test_the_python_api_refuses_too(trained, tmp_path):
    import dataclasses

    from voodoo_quant.tools.export import ExportConfig, export

    root, d, _, res = trained
    bad = dataclasses.replace(res.assignment, imatrix_sha256="0" * 64)
    with pytest.raises(provenance.ProvenanceMismatchError, match="imatrix mismatch.*0{64}"):
        export(ExportConfig(model=d, assignment=bad, output_dir=tmp_path, output_name="x.gguf"))


@pytest.mark.slow
def test_export_refuses_other_base_weights_and_the_override_exports_anyway(trained, tmp_path):
    from safetensors.torch import load_file

    root, d, _, res = trained
    sd = load_file(str(d / "model.safetensors"))
    k = "model.layers.1.mlp.down_proj.weight"
    sd[k] = sd[k].clone()
    sd[k][0, 0] += 1e-3  # one weight of one tensor
    torch.save(sd, tmp_path / "other.pt")
    args = ["--model", d, "--assignment", root / "run" / "assignment.json", "--output_dir", tmp_path / "o",
            "--output_name", "x.gguf", "--base_checkpoint", tmp_path / "other.pt"]
    line = _one_line_error(_export_cli(*args), "base weights mismatch", res.assignment.weights_sha256,
                           "--base_checkpoint")
    other = re.findall(r"[0-9a-f]{64}", line)
    assert len(set(other)) == 2, line  # both hashes named
    assert not (tmp_path / "o" / "x.gguf").exists()
    # The unmodified weights as a base checkpoint: the same hash, accepted.
    torch.save(load_file(str(d / "model.safetensors")), tmp_path / "same.pt")
    r = _export_cli(*args[:-1], tmp_path / "same.pt")
    assert r.exit_code == 0, r.stderr
    # The expert override: the mismatching weights export, with the recorded imatrix.
    r = _export_cli(*args, "--allow_mismatch", "--overwrite")
    assert r.exit_code == 0, r.stderr
    assert "imatrix: " + res.assignment.imatrix in " ".join(r.stdout.split())
    shutil.rmtree(tmp_path / "o")


def test_budget_counts_the_tensors_no_candidate_covers(tmp_path):
    """No silent F32 in the size accounting either: a MoE's merged expert stacks (quantized by
    stock llama-quantize, not selectable) are counted at the base type Q8_0, taken off the target
    before the gates share it, and recorded in the assignment (export writes and checks them)."""
    import transformers as T

    from voodoo_quant.selection.budget import BASE_TYPE
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    torch.manual_seed(0)
    T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=512, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=True, max_position_embeddings=128)).save_pretrained(tmp_path / "moe")
    (tmp_path / "data").mkdir()
    torch.save(torch.randint(0, 512, (8, 40), generator=torch.Generator().manual_seed(1)),
               tmp_path / "data" / "train_tokens.pt")
    kw = dict(model=str(tmp_path / "moe"), data_dir=str(tmp_path / "data"), seq_len=32, batch_size=2, max_steps=2,
              candidate_types=("Q8_0", "Q4_K", "Q2_K"), output_dir=str(tmp_path / "run"), guarantee=False, search_evals=0)
    exps = {f"blk.{b}.ffn_{k}_exps.weight" for b in range(2) for k in ("gate", "up", "down")}
    per = qt.tensor_bytes("Q8_0", (4, 256, 256))
    # The experts alone weigh more than 0.8 of the whole at Q8_0 allows the rest: refused, naming them.
    from voodoo_quant.core.errors import ConfigError

    with pytest.raises(ConfigError, match=f"6 tensor\\(s\\) no candidate covers, fixed at Q8_0: {6 * per:,} bytes"):
        Trainer(TrainConfig(compression_ratio=0.8, **kw)).prepare(build=False)
    tr = Trainer(TrainConfig(compression_ratio=0.9, **kw))
    res = tr.train()
    b = tr.run.budget
    assert {n for n, _, _ in b.fixed} == exps and b.fixed_bytes == 6 * per
    assert b.target_bytes == round(0.9 * (b.q8_bytes + 6 * per)) - 6 * per
    assert res.assignment.fixed == {n: [BASE_TYPE, per] for n in exps}
    assert Assignment.load(tmp_path / "run" / "assignment.json").fixed == res.assignment.fixed
