"""`voodoo export` per architecture, against the stock llama.cpp tools (tiny random models).

For Llama, Qwen2 (q/k/v biases, untied head, as Qwen2.5), Qwen3, Qwen3.5 and LFM2: (1) the layout map reproduces the converter's F32 GGUF
tensor for tensor, both ways; (2) every exported tensor's bytes equal stock
``llama-quantize --tensor-type-file <ours> --imatrix <same>``; (3) the file runs in stock
``llama-perplexity`` and its PPL equals the torch PPL of the baked student within 0.5 %.
"""

from __future__ import annotations

import math
import re
import shutil
import subprocess

import numpy as np
import pytest

from voodoo_quant.core import paths
from voodoo_quant.core import qtypes as qt
from voodoo_quant.gguf import converter
from voodoo_quant.gguf.layout import model_layouts
from voodoo_quant.selection.assignment import Assignment, TensorChoice
from voodoo_quant.training import provenance

ARCHS = ("llama", "qwen2", "qwen3", "qwen3_5", "lfm2")
# Cheap-to-initialize types (IQ2/IQ1 grids cost seconds per process), with and without imatrix.
TYPES = ("Q4_K", "Q6_K", "IQ4_XS", "Q5_K", "Q3_K", "Q8_0", "Q2_K", "Q4_0")
N_CTX = 128
PPL_TOL = 0.005


def _build(arch: str, out, tok_dir):
    import torch
    import transformers as T

    common = dict(vocab_size=49152, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=1, eos_token_id=2, tie_word_embeddings=True,
                  max_position_embeddings=512)
    torch.manual_seed(0)
    if arch == "llama":
        m = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, head_dim=64, **common))
    elif arch == "qwen2":
        m = T.Qwen2ForCausalLM(T.Qwen2Config(num_hidden_layers=2, **{**common, "tie_word_embeddings": False}))
    elif arch == "qwen3":
        m = T.Qwen3ForCausalLM(T.Qwen3Config(num_hidden_layers=2, head_dim=64, **common))
    elif arch == "qwen3_5":
        m = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(
            num_hidden_layers=4, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
            linear_key_head_dim=64, linear_value_head_dim=64,
            layer_types=["linear_attention"] * 3 + ["full_attention"], **common))
    else:
        m = T.Lfm2ForCausalLM(T.Lfm2Config(num_hidden_layers=4, layer_types=["conv", "conv", "full_attention", "conv"], **common))
    m.save_pretrained(out)
    for f in tok_dir.iterdir():
        shutil.copy(f, out / f.name)
    return out


@pytest.fixture(scope="module", params=ARCHS)
def exported(request, tmp_path_factory, smollm2_tok_dir):
    from voodoo_quant.gguf.imatrix import Entry, Imatrix
    from voodoo_quant.tools.export import ExportConfig, export

    arch = request.param
    if arch == "qwen2":
        # transformers 5 loads a qwen2 model's tokenizer as Qwen2Tokenizer, which replaces the
        # tokenizer's pre-tokenizer by Qwen2's; on the SmolLM2 vocabulary these tiny models share, the
        # converter knows no hash for the result and refuses. The qwen2 layout and bytes are checked
        # on the real Qwen2.5 model (tests/test_bench_models.py, where `make bench-models` ran).
        pytest.skip("the converter takes no SmolLM2-vocabulary tokenizer on a qwen2 model under transformers 5")
    root = tmp_path_factory.mktemp(f"export_{arch}")
    d = _build(arch, root / f"Tiny-{arch}", smollm2_tok_dir)
    layouts = model_layouts(d)
    rng = np.random.default_rng(0)
    choices, entries = {}, {}
    for i, (n, lay) in enumerate(sorted(layouts.items())):
        if not lay.quantizable:
            continue
        q = "Q8_0" if lay.gguf_name == "token_embd.weight" else qt.resolve_for_row(TYPES[i % len(TYPES)], lay.n_per_row).name
        choices[n] = TensorChoice(name=n, qtype=q, shape=lay.hf_shape, nbytes=qt.tensor_bytes(q, (lay.n_rows, lay.n_per_row)),
                                  gguf_name=lay.gguf_name)
        entries[lay.gguf_name] = Entry(sums=rng.uniform(0.1, 10, lay.n_per_row).astype(np.float32) * 37, counts=np.array([37]))
    imatrix = Imatrix(entries=entries, datasets=["synthetic"], chunk_count=3, chunk_size=512)
    imatrix.save_gguf(root / "imatrix.gguf")
    asg = provenance.stamp(Assignment(tensors=choices, model=str(d)), d, imatrix=root / "imatrix.gguf")
    asg.save(root / "assignment.json")
    res = export(ExportConfig(model=d, assignment=root / "assignment.json", output_dir=root / "out",
                              imatrix=root / "imatrix.gguf", size_percent=45, keep_f32=True))
    return arch, d, layouts, asg, res, root


def test_sizes_without_a_badge_are_named_by_their_number(tmp_path):
    from voodoo_quant.core.errors import ConfigError
    from voodoo_quant.tools.export import ExportConfig, canonical_name

    assert canonical_name("M", 45) == "M.Voodoo45_IQ2_M.gguf"
    for n in (85, 90, 95):
        assert canonical_name("M", n) == f"M.Voodoo{n}.gguf"
    (tmp_path / "m").mkdir()
    (tmp_path / "m" / "config.json").write_text("{}")
    (tmp_path / "a.json").write_text("{}")
    cfg = ExportConfig(model=tmp_path / "m", assignment=tmp_path / "a.json", output_dir=tmp_path, size_percent=95)
    assert cfg.file_name() == "m.Voodoo95.gguf"
    for bad in (0, -5, 401):
        with pytest.raises(ConfigError, match="--size_percent"):
            ExportConfig(model=tmp_path / "m", assignment=tmp_path / "a.json", output_dir=tmp_path, size_percent=bad)


def test_every_type_has_a_file_type():
    from voodoo_quant.tools.export import _TYPE_TO_FTYPE, _ftype

    assert _ftype({"MXFP4": 3, "Q8_0": 1}) == qt.LLAMA_FTYPES["MXFP4_MOE"]
    assert set(_TYPE_TO_FTYPE) == set(qt.QTYPES)


def _tensors(path):
    return {t.name: t for t in converter.vendored_gguf().GGUFReader(path).tensors}


@pytest.mark.slow
def test_layout_reproduces_converter(exported):
    from safetensors.numpy import load_file

    arch, d, layouts, _, res, _ = exported
    f32 = _tensors(res.f32_gguf)
    sd = load_file(str(d / "model.safetensors"))
    assert layouts, arch
    for n, lay in layouts.items():
        g = np.asarray(f32[lay.gguf_name].data).reshape(lay.n_rows, lay.n_per_row)
        assert np.array_equal(lay.to_gguf(sd[n]), g), f"{arch}: {n} → {lay.gguf_name} differs from the converter"
        assert np.array_equal(lay.from_gguf(g), sd[n]), f"{arch}: {lay.gguf_name} → {n} does not map back"
    if arch == "qwen3_5":  # the V-head reorder is a real permutation, not an identity
        assert not layouts["model.layers.0.linear_attn.out_proj.weight"].is_identity
    if arch == "llama":  # the rope q/k row permutation
        assert layouts["model.layers.0.self_attn.q_proj.weight"].rows is not None


@pytest.mark.slow
def test_bytes_equal_stock_llama_quantize(exported):
    arch, _, _, asg, res, root = exported
    assert res.path.name == f"Tiny-{arch}.Voodoo45_IQ2_M.gguf"
    stock = root / "stock.gguf"
    p = subprocess.run([str(paths.tool_path("llama-quantize")), "--tensor-type-file", str(res.tensor_type_file),
                        "--imatrix", str(root / "imatrix.gguf"), str(res.f32_gguf), str(stock), "Q8_0", "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    ours, theirs = _tensors(res.path), _tensors(stock)
    assert sorted(ours) == sorted(theirs)
    sel = {c.gguf_name: c for c in asg.tensors.values()}
    diff = [n for n in ours if ours[n].tensor_type != theirs[n].tensor_type
            or not np.array_equal(np.asarray(ours[n].data).view(np.uint8), np.asarray(theirs[n].data).view(np.uint8))]
    assert not diff, f"{arch}: {len(diff)} tensor(s) differ from llama-quantize, e.g. {diff[:3]}"
    for name, c in sel.items():
        assert ours[name].tensor_type.name == c.qtype and int(ours[name].n_bytes) == c.nbytes
    kv = converter.vendored_gguf().GGUFReader(res.path).fields
    assert kv["quantize.imatrix.entries_count"].contents() == len(sel)
    assert kv["quantize.imatrix.chunks_count"].contents() == 3
    assert abs(kv["voodoo.bpw"].contents() - res.bpw) < 1e-4


def _torch_ppl(model, tokens: list[int]) -> float:
    """llama-perplexity's estimate (tools/perplexity/perplexity.cpp): chunks of n_ctx tokens,
    only the second half of each chunk scored."""
    import torch

    nll, cnt = 0.0, 0
    first = N_CTX // 2
    with torch.no_grad():
        for i in range(len(tokens) // N_CTX):
            ids = torch.tensor([tokens[i * N_CTX:(i + 1) * N_CTX]])
            logp = torch.log_softmax(model(ids).logits[0].double(), dim=-1)
            tgt = ids[0, first + 1:]
            nll -= float(logp[first:N_CTX - 1].gather(1, tgt[:, None]).sum())
            cnt += N_CTX - 1 - first
    return math.exp(nll / cnt)


@pytest.mark.slow
@pytest.mark.parametrize("exported", ["llama"], indirect=True)  # the path does not depend on the architecture
def test_a_conversion_made_earlier_gives_the_same_file_and_is_checked(exported, tmp_path):
    """--converted: the file is byte for byte the one export makes by converting; a conversion
    of other weights, or one that cannot be checked, is refused before anything is written."""
    import dataclasses

    from voodoo_quant.core.errors import ConfigError
    from voodoo_quant.tools.export import ExportConfig, export
    from voodoo_quant.training.provenance import ProvenanceMismatchError

    _, d, _, asg, res, root = exported
    again = export(ExportConfig(model=d, assignment=root / "assignment.json", output_dir=tmp_path / "a",
                                imatrix=root / "imatrix.gguf", size_percent=45, converted=res.f32_gguf))
    assert again.path.read_bytes() == res.path.read_bytes() and again.f32_gguf is None
    assert res.f32_gguf.is_file()  # read, not moved
    other = tmp_path / "other.gguf"  # the same model with one selected tensor's weights changed
    gguf = converter.vendored_gguf()
    r = gguf.GGUFReader(res.f32_gguf)
    w = gguf.GGUFWriter(other, r.fields["general.architecture"].contents())
    victim = next(t.name for t in r.tensors if t.name.endswith("attn_q.weight"))
    for t in r.tensors:
        data = np.array(t.data)
        w.add_tensor(t.name, data + np.float32(1e-3) if t.name == victim else data, raw_dtype=t.tensor_type)
    w.write_header_to_file(); w.write_kv_data_to_file(); w.write_tensors_to_file(); w.close()
    with pytest.raises(ProvenanceMismatchError, match="base weights mismatch"):
        export(ExportConfig(model=d, assignment=root / "assignment.json", output_dir=tmp_path / "b",
                            imatrix=root / "imatrix.gguf", size_percent=45, converted=other))
    assert not (tmp_path / "b" / res.path.name).exists()
    unchecked = dataclasses.replace(asg, weights_sha256=None)
    with pytest.raises(ProvenanceMismatchError, match="records no weights_sha256"):
        export(ExportConfig(model=d, assignment=unchecked, output_dir=tmp_path / "c", imatrix=root / "imatrix.gguf",
                            size_percent=45, converted=res.f32_gguf))
    with pytest.raises(ConfigError, match="--base_checkpoint"):
        ExportConfig(model=d, assignment=root / "assignment.json", output_dir=tmp_path, size_percent=45,
                     converted=res.f32_gguf, base_checkpoint=root / "assignment.json")


def test_perplexity_llama_cpp_equals_torch(exported, shakespeare_text_file):
    import torch
    import transformers as T

    from voodoo_quant.core import ggml

    arch, d, layouts, asg, res, root = exported
    text = shakespeare_text_file.read_text(encoding="utf-8")[:3000]
    tf = root / "text.txt"
    tf.write_text(text, encoding="utf-8")
    p = subprocess.run([str(paths.tool_path("llama-perplexity")), "-m", str(res.path), "-f", str(tf), "-c", str(N_CTX),
                        "-b", str(N_CTX), "-t", "2"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"Final estimate: PPL = ([0-9.]+)", p.stdout + p.stderr)
    assert m, (p.stdout + p.stderr)[-2000:]
    ppl_cpp = float(m.group(1))
    assert math.isfinite(ppl_cpp)

    # The baked student: every selected tensor = its exported bytes, dequantized, mapped back.
    model = T.AutoModelForCausalLM.from_pretrained(d, dtype=torch.float32).eval()
    ours = _tensors(res.path)
    params = dict(model.named_parameters())
    for c in asg.tensors.values():
        lay = layouts[c.name]
        t = ours[c.gguf_name]
        w = ggml.lib().dequantize(np.asarray(t.data).view(np.uint8), c.qtype, (lay.n_rows, lay.n_per_row))
        with torch.no_grad():
            params[c.name].copy_(torch.from_numpy(lay.from_gguf(w)))
    tok = T.AutoTokenizer.from_pretrained(d)
    tokens = tok(text, add_special_tokens=False)["input_ids"]
    ppl_torch = _torch_ppl(model, tokens)
    rel = abs(ppl_cpp - ppl_torch) / ppl_torch
    print(f"\n{arch}: PPL llama.cpp {ppl_cpp:.4f} torch {ppl_torch:.4f} rel diff {rel:.2e}")
    assert rel <= PPL_TOL, f"{arch}: llama.cpp PPL {ppl_cpp} vs torch {ppl_torch} ({rel:.2%})"


@pytest.mark.slow
def test_quantizable_tensors_off_the_assignment_are_written_as_stock_base_type(tmp_path, smollm2_tok_dir):
    """No silent F32: a MoE's expert tensors (the converter merges per-expert weights, so they are
    not selectable) are quantized by stock llama-quantize; export writes them as its base type
    Q8_0 would, reports them and counts their bytes. The whole file equals llama-quantize's."""
    import torch
    import transformers as T

    from voodoo_quant.gguf.imatrix import Entry, Imatrix
    from voodoo_quant.tools.export import BASE_TYPE, ExportConfig, export

    torch.manual_seed(0)
    d = tmp_path / "Tiny-moe"
    T.Qwen3MoeForCausalLM(T.Qwen3MoeConfig(
        vocab_size=49152, hidden_size=256, intermediate_size=512, moe_intermediate_size=256, num_experts=4,
        num_experts_per_tok=2, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=64,
        tie_word_embeddings=True, max_position_embeddings=512, bos_token_id=1, eos_token_id=2)).save_pretrained(d)
    for f in smollm2_tok_dir.iterdir():
        shutil.copy(f, d / f.name)
    layouts = model_layouts(d)
    rng = np.random.default_rng(0)
    choices, entries = {}, {}
    for i, (n, lay) in enumerate(sorted(layouts.items())):
        if lay.quantizable:
            q = TYPES[i % len(TYPES)]
            choices[n] = TensorChoice(name=n, qtype=q, shape=lay.hf_shape, gguf_name=lay.gguf_name,
                                      nbytes=qt.tensor_bytes(q, (lay.n_rows, lay.n_per_row)))
            entries[lay.gguf_name] = Entry(sums=rng.uniform(0.1, 10, lay.n_per_row).astype(np.float32) * 5,
                                           counts=np.array([5]))
    Imatrix(entries=entries, datasets=["synthetic"], chunk_count=1, chunk_size=512).save_gguf(tmp_path / "im.gguf")
    asg = provenance.stamp(Assignment(tensors=choices, model=str(d)), d, imatrix=tmp_path / "im.gguf")
    res = export(ExportConfig(model=d, assignment=asg, output_dir=tmp_path / "out", output_name="moe.gguf",
                              keep_f32=True))
    exps = {f"blk.{b}.ffn_{k}_exps.weight" for b in range(2) for k in ("gate", "up", "down")}
    assert set(res.fixed) == exps and set(res.fixed.values()) == {BASE_TYPE}
    ours = _tensors(res.path)
    assert res.fixed_bytes == sum(int(ours[n].n_bytes) for n in exps) == 6 * qt.tensor_bytes("Q8_0", (4, 256, 256))
    assert all(tuple(int(s) for s in ours[n].shape) == (256, 256, 4) for n in exps)  # still 3-D
    stock = tmp_path / "stock.gguf"
    p = subprocess.run([str(paths.tool_path("llama-quantize")), "--tensor-type-file", str(res.tensor_type_file),
                        "--imatrix", str(tmp_path / "im.gguf"), str(res.f32_gguf), str(stock), BASE_TYPE, "2"],
                       capture_output=True, text=True)
    assert p.returncode == 0, p.stderr[-2000:]
    theirs = _tensors(stock)
    assert sorted(ours) == sorted(theirs)
    diff = [n for n in ours if ours[n].tensor_type != theirs[n].tensor_type
            or not np.array_equal(np.asarray(ours[n].data).view(np.uint8), np.asarray(theirs[n].data).view(np.uint8))]
    assert not diff, f"{len(diff)} tensor(s) differ from llama-quantize, e.g. {diff[:3]}"
