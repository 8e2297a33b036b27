"""The notebook facade on a tiny model: quantize to a target, save a GGUF that holds the assignment."""

import pytest

from voodoo_quant.api import VoodooConfig, VoodooQuantizer
from voodoo_quant.errors import ConfigError


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

    from voodoo_quant.converter import vendored_gguf

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
