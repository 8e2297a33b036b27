"""The notebook facade on a tiny model: quantize to a target, save a GGUF that holds the assignment."""

import pytest

from voodoo_quant.api import VoodooConfig, VoodooQuantizer
from voodoo_quant.core.errors import ConfigError


def test_facade_is_importable_from_the_package_root_and_cheap():
    import subprocess
    import sys

    code = ("import sys, voodoo_quant; heavy = {'torch', 'transformers'} & set(sys.modules); "
            "from voodoo_quant import VoodooQuantizer, VoodooConfig; "
            "import voodoo_quant.api as api; assert VoodooQuantizer is api.VoodooQuantizer and VoodooConfig is api.VoodooConfig; "
            "print(sorted(heavy))")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    assert p.stdout.strip() == "[]"  # `import voodoo_quant` pulls in neither torch nor transformers


def test_config_validation():
    with pytest.raises(ConfigError, match="calib_texts"):
        VoodooConfig(calib_texts=[])
    with pytest.raises(ConfigError, match="not both"):
        VoodooConfig(compression_ratio=0.5, target_bits=4.0, calib_texts=["x"])
    assert VoodooConfig(calib_texts="some text").compression_ratio == 0.45


@pytest.mark.slow
def test_quantize_loaded_model_and_save_gguf(tiny_llama_hf_dir, shakespeare_text_file, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from voodoo_quant.gguf.converter import vendored_gguf

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_hf_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_llama_hf_dir)
    text = shakespeare_text_file.read_text()[:20000]
    cfg = VoodooConfig(compression_ratio=0.6, calib_texts=[text], seq_len=64, max_steps=3,
                       candidate_types=("Q8_0", "Q5_0", "Q4_0"), workdir=str(tmp_path / "work"))
    q = VoodooQuantizer(model, tok, cfg).quantize()
    res = q.save(tmp_path / "tiny.Voodoo60.gguf")
    assert res.path.is_file()
    reader = vendored_gguf().GGUFReader(str(res.path))
    types = {t.name: t.tensor_type.name for t in reader.tensors}
    nbytes = {t.name: int(t.n_bytes) for t in reader.tensors}
    for choice in q.assignment.tensors.values():
        assert types[choice.gguf_name] == choice.qtype
        assert nbytes[choice.gguf_name] == choice.nbytes
    # The size the trainer accounted for is exactly the selected tensors' bytes in the file.
    assert sum(nbytes[c.gguf_name] for c in q.assignment.tensors.values()) == q.assignment.total_bytes
    b = q.result.bake
    assert q.assignment.total_bytes <= q.assignment.target_bytes * 1.02 and b.total_bytes == q.assignment.total_bytes


def test_model_dir_is_saved_whole_and_a_half_one_is_not_reused(tiny_llama_hf_dir, tmp_path):
    import shutil

    import torch
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from voodoo_quant.model.modeling import hf_dir_missing

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_hf_dir, dtype=torch.float32)
    tok = AutoTokenizer.from_pretrained(tiny_llama_hf_dir)
    work = tmp_path / "work"
    q = VoodooQuantizer(model, tok, VoodooConfig(calib_texts=["x"], workdir=str(work)))
    hf = work / "model"
    want = {k: v.clone() for k, v in model.state_dict().items()}

    def saved_whole():
        assert hf_dir_missing(hf) == []
        got = load_file(hf / "model.safetensors")
        assert all(torch.equal(got[k], want[k]) for k in got) and len(got) >= len(want) - 1  # tied head: one copy
        assert not list(work.glob(".model.*")), list(work.glob(".model.*"))  # no temporary left behind

    # A run killed while saving (as save_pretrained into the final dir left it): config.json, the
    # weights cut short, no tokenizer. It must be saved again, not taken for the model.
    hf.mkdir(parents=True)
    model.save_pretrained(tmp_path / "full")
    shutil.copy(tmp_path / "full" / "config.json", hf)
    full = (tmp_path / "full" / "model.safetensors").read_bytes()
    (hf / "model.safetensors").write_bytes(full[: len(full) // 2])
    (work / ".model.abcd.tmp").mkdir()  # the temporary of a save killed before its rename
    assert set(hf_dir_missing(hf)) == {"tokenizer_config.json", "model.safetensors"}
    assert q.model_dir() == hf
    saved_whole()
    # Only config.json (killed before the weights) is no model either.
    shutil.rmtree(hf)
    hf.mkdir()
    shutil.copy(tmp_path / "full" / "config.json", hf)
    q.model_dir()
    saved_whole()
    # A whole directory is reused as it is.
    (hf / "marker").write_text("kept")
    q.model_dir()
    assert (hf / "marker").read_text() == "kept"


def test_hf_dir_missing_names_a_missing_shard(tiny_llama_hf_dir, tmp_path):
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from voodoo_quant.model.modeling import hf_dir_missing

    model = AutoModelForCausalLM.from_pretrained(tiny_llama_hf_dir, dtype=torch.float32)
    d = tmp_path / "sharded"
    model.save_pretrained(d, max_shard_size="2MB")
    AutoTokenizer.from_pretrained(tiny_llama_hf_dir).save_pretrained(d)
    shards = sorted(p.name for p in d.glob("model-*.safetensors"))
    assert len(shards) > 1 and hf_dir_missing(d) == []
    (d / shards[-1]).unlink()
    assert hf_dir_missing(d) == [shards[-1]]


def test_write_dir_leaves_nothing_when_the_writer_fails(tmp_path):
    from voodoo_quant.core import fileio

    def fails(tmp):
        (tmp / "config.json").write_text("{}")
        raise KeyboardInterrupt  # as a Ctrl-C in the middle of save_pretrained

    with pytest.raises(KeyboardInterrupt):
        fileio.write_dir(tmp_path / "model", fails)
    assert list(tmp_path.iterdir()) == []
    fileio.write_dir(tmp_path / "model", lambda tmp: (tmp / "config.json").write_text("{}"))
    assert (tmp_path / "model" / "config.json").read_text() == "{}"
    with pytest.raises(fileio.OutputExistsError):
        fileio.write_dir(tmp_path / "model", lambda tmp: None)
