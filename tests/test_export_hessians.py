"""Export needs the compensation Hessians only for the tensors whose bytes are compensated.

An assignment from a compensated run (``--error_compensation gptq``) whose every selected tensor
is recorded plain (a guarantee reference's off-menu type, or a float type) exports without the
Hessians file, the same tensor bytes as the same assignment recorded without compensation; a
tensor recorded compensated (or, in an assignment older than the per-tensor record, any quantized
one) still makes a missing file, or a file without its Hessian, a one-line typed refusal before
any conversion. The file's ``voodoo.error_compensation`` key says so only of a file some of whose
bytes are compensated.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from voodoo_quant.core import fileio
from voodoo_quant.core import qtypes as qt
from voodoo_quant.gguf import header
from voodoo_quant.gguf.layout import model_layouts
from voodoo_quant.selection.assignment import Assignment, TensorChoice
from voodoo_quant.training import provenance
from voodoo_quant.training.provenance import ProvenanceMismatchError


@pytest.fixture(scope="module")
def plain(tiny_llama_hf_dir):
    """(model dir, a stamped assignment with no compensation: Q8_0/Q4_0 alternately)."""
    d = tiny_llama_hf_dir
    choices = {}
    for i, (n, lay) in enumerate(sorted(model_layouts(d).items())):
        if lay.quantizable:
            q = ("Q8_0", "Q4_0")[i % 2]
            choices[n] = TensorChoice(name=n, qtype=q, shape=lay.hf_shape, gguf_name=lay.gguf_name,
                                      nbytes=qt.tensor_bytes(q, (lay.n_rows, lay.n_per_row)))
    return d, provenance.stamp(Assignment(tensors=choices, model=str(d)), d)


def _compensated_run(asg: Assignment, hessians, flags: dict[str, bool | None] | None = None,
                     default: bool | None = False) -> Assignment:
    """`asg` as a gptq run recording `hessians` (path), each tensor's `compensated` from `flags`."""
    flags = flags or {}
    sha = fileio.sha256_file(hessians) if hessians.is_file() else "0" * 64
    return dataclasses.replace(
        asg, compensation={"method": "gptq", "damp": 0.1, "sweep": "fixed", "key": "k", "hessians": str(hessians),
                           "sha256": sha, "tensors": len(asg.tensors)},
        tensors={k: dataclasses.replace(t, compensated=flags.get(k, default)) for k, t in asg.tensors.items()})


def test_an_assignment_with_no_compensated_tensor_exports_without_the_hessians(plain, tmp_path):
    from voodoo_quant.tools.export import ExportConfig, export

    d, asg = plain
    gone = tmp_path / "run" / "hessians.safetensors"  # never written: the run's file was deleted
    comp = _compensated_run(asg, gone)
    assert provenance.compensated_tensors(comp) == [] and provenance.resolve_compensation(comp, allow=False) == {}
    out = export(ExportConfig(model=d, assignment=comp, output_dir=tmp_path / "out", output_name="t.gguf",
                              keep_f32=True))
    ref = export(ExportConfig(model=d, assignment=asg, output_dir=tmp_path / "ref", output_name="t.gguf",
                              converted=out.f32_gguf))
    ours, theirs = header.tensor_table(out.path), header.tensor_table(ref.path)
    assert ours == theirs and len(ours) > len(asg.tensors) // 2
    assert {ours[t.gguf_name][0] for t in asg.tensors.values()} == {"Q8_0", "Q4_0"}


def test_the_compensation_key_is_written_only_over_compensated_bytes(plain, tmp_path):
    """An assignment of a compensated run that selects no compensated tensor exports stock
    llama-quantize's bytes: its GGUF does not claim compensation. One compensated tensor: it does,
    and that tensor alone holds other bytes."""
    from voodoo_quant.candidates.hessian_store import write_hessians
    from voodoo_quant.tools.export import ExportConfig, export

    d, asg = plain
    key = "voodoo.error_compensation"
    none = export(ExportConfig(model=d, assignment=_compensated_run(asg, tmp_path / "gone.safetensors"),
                               output_dir=tmp_path / "none", output_name="t.gguf", keep_f32=True))
    kv, _, _ = header.read_file(none.path)
    assert "voodoo.bpw" in kv and key not in kv, sorted(k for k in kv if k.startswith("voodoo."))

    name = next(k for k, t in sorted(asg.tensors.items()) if t.qtype == "Q4_0" and ".layers." in k)
    n = asg.tensors[name].shape[-1]
    rng = np.random.default_rng(0)
    x = rng.normal(size=(4 * n, n)) @ (rng.normal(size=(n, n)) / np.sqrt(n) + np.eye(n))  # correlated inputs
    h = tmp_path / "hessians.safetensors"
    write_hessians(h, {name: n}, {}, "k", [(name, (x.T @ x).astype(np.float32))])
    one = export(ExportConfig(model=d, assignment=_compensated_run(asg, h, {name: True}), output_dir=tmp_path / "one",
                              output_name="t.gguf", converted=none.f32_gguf))
    assert header.read_file(one.path)[0][key] == "gptq"
    ours, theirs = header.tensor_table(one.path), header.tensor_table(none.path)
    g = asg.tensors[name].gguf_name
    assert [k for k in ours if ours[k] != theirs[k]] == [g]


@pytest.mark.parametrize("flag", [True, None])
def test_a_compensated_tensor_without_its_hessians_is_refused_before_converting(plain, tmp_path, flag, monkeypatch):
    """True: recorded compensated; None: an assignment older than the per-tensor record."""
    from voodoo_quant.gguf import converter
    from voodoo_quant.tools.export import ExportConfig, export

    d, asg = plain
    name = sorted(asg.tensors)[0]
    comp = _compensated_run(asg, tmp_path / "gone.safetensors", {name: flag})
    assert provenance.compensated_tensors(comp) == [name]
    monkeypatch.setattr(converter, "convert", lambda *a, **k: pytest.fail("converted before refusing"))
    for allow in (False, True):  # the override cannot write bytes it cannot make
        with pytest.raises(ProvenanceMismatchError, match=f"Hessians missing: .*1 compensated tensor.*{name}"):
            export(ExportConfig(model=d, assignment=comp, output_dir=tmp_path / "out", output_name="t.gguf",
                                allow_mismatch=allow))
    assert not (tmp_path / "out" / "t.gguf").exists()


def test_a_hessians_file_without_a_compensated_tensors_hessian_is_refused(plain, tmp_path):
    from voodoo_quant.candidates.hessian_store import write_hessians

    _, asg = plain
    a, b = sorted(asg.tensors)[:2]
    n = asg.tensors[b].shape[-1]
    h = tmp_path / "hessians.safetensors"
    write_hessians(h, {b: n}, {}, "k", [(b, np.eye(n, dtype=np.float32))])
    only_b = _compensated_run(asg, h, {b: True})
    assert set(provenance.resolve_compensation(only_b, allow=False)) == {b}  # b's Hessian is there
    both = _compensated_run(asg, h, {a: True, b: True})
    with pytest.raises(ProvenanceMismatchError, match=f"Hessians incomplete: .*1 tensor.*{a}"):
        provenance.resolve_compensation(both, allow=True)
