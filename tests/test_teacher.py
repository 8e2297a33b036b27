"""`voodoo make-teacher`: base + Q8_0 teacher from an HF dir, a wrapped dir and a GGUF; de-gridding."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.model.modeling import source_identity
from voodoo_quant.tools.teacher import degrid, grid_step, load_base, load_teacher, module_from_checkpoint

runner = CliRunner()


def _run(*args):
    r = runner.invoke(app, ["make-teacher", *map(str, args)])
    assert r.exit_code == 0, r.output + r.stderr
    return r


def test_from_hf_dir_teacher_is_ggml_q8_0(tiny_llama_hf_dir, tmp_path, vendored_gguf_quants):
    """The teacher's packed blocks and values against an independent reference: gguf-py's numpy
    Q8_0 (the vendored tree's; docs/facts.md: its bytes equal libggml's), not the bridge that made them."""
    import sys

    Q8_0 = sys.modules[vendored_gguf_quants.__package__ + ".constants"].GGMLQuantizationType.Q8_0
    _run("--model", tiny_llama_hf_dir, "--output_dir", tmp_path, "--base_name", "b.pt", "--teacher_name", "t.pt")
    src = load_file(tiny_llama_hf_dir / "model.safetensors")
    base, bh = load_base(tmp_path / "b.pt")
    teacher, th = load_teacher(tmp_path / "t.pt")
    raw = torch.load(tmp_path / "t.pt", weights_only=True)
    assert bh["source"] == th["source"] == source_identity(tiny_llama_hf_dir).to_dict()
    assert set(base) == set(teacher) == set(src) - {"lm_head.weight"}  # tied: one tensor
    q8 = 0
    for name, w in src.items():
        if name == "lm_head.weight":
            continue
        assert base[name].dtype == torch.bfloat16 and torch.equal(base[name], w)
        w32 = w.float().numpy()
        if w.ndim == 2:
            blocks = vendored_gguf_quants.quantize(np.ascontiguousarray(w32), Q8_0)
            ref = vendored_gguf_quants.dequantize(blocks, Q8_0).reshape(w32.shape)
            got = teacher[name].numpy()
            bad = int((got != ref).sum())
            assert bad == 0, f"{name}: {bad} of {ref.size} weights differ from gguf-py's Q8_0"
            e = raw["tensors"][name]
            packed = np.empty((w32.shape[0], w32.shape[1] // 32), dtype=[("d", "<f2"), ("qs", "i1", (32,))])
            packed["d"], packed["qs"] = e["d"].numpy(), e["qs"].numpy().reshape(packed.shape + (32,))
            assert packed.tobytes() == blocks.tobytes(), f"{name}: packed Q8_0 blocks differ from gguf-py's"
            q8 += 1
        else:
            assert torch.equal(teacher[name], w.float())
    assert q8 == 15
    # the teacher runs as a model
    m = module_from_checkpoint(tmp_path / "t.pt")
    assert m(torch.tensor([[1, 2, 3]])).logits.shape == (1, 3, 49152)


def test_strip_prefix_on_wrapped_model(tiny_llama_hf_dir, tmp_path):
    wrapped = tmp_path / "wrapped"
    wrapped.mkdir()
    src = load_file(tiny_llama_hf_dir / "model.safetensors")
    sd = {(f"model.language_model.{k[len('model.'):]}" if k.startswith("model.") else k): v for k, v in src.items()}
    sd["model.visual.proj.weight"] = torch.zeros(8, 8, dtype=torch.bfloat16)
    save_file(sd, wrapped / "model.safetensors")
    shutil.copy(tiny_llama_hf_dir / "config.json", wrapped / "config.json")
    r = runner.invoke(app, ["make-teacher", "--model", str(wrapped), "--output_dir", str(tmp_path / "x")])
    assert r.exit_code != 0 and "--strip_prefix" in r.stderr and len(r.stderr.strip().splitlines()) == 1
    _run("--model", wrapped, "--output_dir", tmp_path / "o", "--strip_prefix", "model.language_model.",
         "--text_model_class", "llama", "--dtype", "float32")
    base, header = load_base(tmp_path / "o" / "wrapped_lm_base.pt")
    assert header["model_class"] == "LlamaForCausalLM" and header["strip_prefix"] == "model.language_model."
    assert set(base) == set(src) - {"lm_head.weight"}
    for k, v in base.items():
        assert v.dtype == torch.float32 and torch.equal(v, src[k].float())


def test_degrid_is_seeded_and_within_half_step(ggml_lib):
    rng = np.random.default_rng(0)
    w = rng.standard_normal((8, 128)).astype(np.float32)
    gridded = torch.from_numpy(ggml_lib.dequantize(ggml_lib.quantize(w, "Q4_1"), "Q4_1", w.shape))
    a = degrid("blk.0.w", gridded, 0)
    assert torch.equal(a, degrid("blk.0.w", gridded, 0))
    assert not torch.equal(a, degrid("blk.0.w", gridded, 1))
    assert not torch.equal(a, degrid("blk.1.w", gridded, 0))
    step = grid_step(gridded).repeat_interleave(32, dim=1)
    assert (step > 0).all()
    assert ((a - gridded).abs() <= step / 2).all() and (a != gridded).float().mean() > 0.99
    # the point of de-gridding: Q4_1 no longer reproduces the weights exactly
    again = ggml_lib.dequantize(ggml_lib.quantize(gridded.numpy(), "Q4_1"), "Q4_1", w.shape)
    assert np.array_equal(again, gridded.numpy())
    moved = ggml_lib.dequantize(ggml_lib.quantize(a.numpy(), "Q4_1"), "Q4_1", w.shape)
    assert not np.array_equal(moved, a.numpy())
    # 1-D tensors and rows that are not a multiple of 32 are left alone
    assert torch.equal(degrid("norm", gridded[0], 0), gridded[0])


@pytest.mark.slow
def test_from_gguf_file_with_degrid_and_hf_out(tiny_llama_f32_gguf, tiny_llama_hf_dir, tmp_path):
    _run("--model", tiny_llama_f32_gguf, "--output_dir", tmp_path, "--dtype", "float32", "--base_name", "b.pt")
    base, header = load_base(tmp_path / "b.pt")
    assert header["source"]["kind"] == "gguf"
    src = load_file(tiny_llama_hf_dir / "model.safetensors")
    for k, v in src.items():  # transformers undoes llama.cpp's Q/K permutation: same tensors
        if k != "lm_head.weight":
            assert torch.equal(base[k], v.float()), k
    _run("--model", tiny_llama_f32_gguf, "--output_dir", tmp_path / "d", "--degrid_seed", "3",
         "--hf_out", tmp_path / "hf")
    assert json.loads((tmp_path / "hf" / "config.json").read_text())["model_type"] == "llama"
    hf = load_file(tmp_path / "hf" / "model.safetensors")
    dbase, dh = load_base(tmp_path / "d" / "tiny_llama_f32_lm_base.pt")
    assert dh["degrid_seed"] == 3
    k = "model.layers.0.mlp.down_proj.weight"
    assert torch.equal(hf[k], degrid(k, src[k].float(), 3)) and not torch.equal(hf[k], src[k].float())


def test_the_degrid_block_follows_the_source_gguf_types(tmp_path, ggml_lib):
    """A GGUF holding a type with 16-weight scales (a Q4_K_M file's Q6_K tensors) is de-gridded
    by 16; one of 32-block types only (the embedded SmolLM2's Q4_1) and an HF dir by 32."""
    import numpy as np

    from voodoo_quant.gguf import converter
    from voodoo_quant.core import qtypes as qt
    from voodoo_quant.tools.teacher import MakeTeacherConfig, degrid_block_for

    gguf = converter.vendored_gguf()
    rng = np.random.default_rng(0)

    def write(path, qtype):
        w = gguf.GGUFWriter(path, "llama")
        m = rng.standard_normal((2, 256)).astype(np.float32)
        data = np.frombuffer(ggml_lib.quantize(m, qtype), dtype=np.uint8)
        w.add_tensor("blk.0.ffn_down.weight", data.reshape(2, -1), raw_shape=data.reshape(2, -1).shape,
                     raw_dtype=gguf.GGMLQuantizationType(qt.get(qtype).id))
        w.write_header_to_file()
        w.write_kv_data_to_file()
        w.write_tensors_to_file()
        w.close()
        return path

    assert degrid_block_for(write(tmp_path / "k.gguf", "Q6_K")) == 16
    assert degrid_block_for(write(tmp_path / "l.gguf", "Q4_1")) == 32
    assert degrid_block_for(tmp_path) == 32
    k = tmp_path / "k.gguf"
    assert MakeTeacherConfig(model=str(k), output_dir=tmp_path / "o", degrid_seed=0).degrid_block == 16
    assert MakeTeacherConfig(model=str(k), output_dir=tmp_path / "o", degrid_seed=0, degrid_block=32).degrid_block == 32
