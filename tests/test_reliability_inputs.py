"""Bad arguments, hostile files and resources, through the real CLI: each one line, non-zero exit.

Every case runs `voodoo train` (or export) in-process with Typer's CliRunner on the tiny
``gate_model_dir`` model and checks: exit code != 0, exactly one ``error: ...`` line that says
what is wrong, no traceback. Also: a pickled payload is refused (and never runs), no shell
strings, every ``torch.load`` is weights-only, output names cannot leave the output directory,
full disks and unwritable dirs are refused before any work.
"""

from __future__ import annotations

import os
import pickle
import re
import shutil
import subprocess
from pathlib import Path

import pytest
import torch
from typer.testing import CliRunner

from voodoo_quant.cli.app import app
from voodoo_quant.core import fileio
from voodoo_quant.core.errors import ConfigError, CorruptFileError

ROOT = Path(__file__).resolve().parents[1]


def _train(d: Path, out: Path, *extra: str, data_dir: Path | None = None) -> list[str]:
    args = ["train", "--model", str(d / "model"), "--data_dir", str(data_dir or d / "data"), "--seq_len", "32",
            "--max_steps", "1", "--output_dir", str(out), "--candidate_types", "Q8_0", "Q4_K"]
    if not any(a in ("--compression_ratio", "--target_bits") for a in extra):
        args += ["--compression_ratio", "0.8"]
    return args + list(extra)


def one_line_error(args: list[str], *, expect: str) -> str:
    res = CliRunner().invoke(app, args)
    assert res.exit_code != 0, res.output
    err = res.stderr if hasattr(res, "stderr") else res.output
    # transformers' own "Loading weights" progress bars may precede it; nothing else may
    lines = [ln for ln in err.splitlines() if ln.strip() and not re.search(r"\d+%\|.*\|", ln)]
    assert len(lines) == 1 and lines[0].startswith("error: "), err
    assert "Traceback" not in res.output
    assert re.search(expect, lines[0]), lines[0]
    return lines[0]


BAD_ARGS = {
    "unknown quant type": (["--candidate_types", "Q9_X"], "Q9_X"),
    "F32 as a candidate": (["--candidate_types", "F32"], "F32 is not a quantization candidate"),
    "invalid JSON upgrades": (["--tensor_upgrades", '[{"pattern": "mlp"'], "not valid JSON"),
    "invalid regex upgrades": (["--tensor_upgrades", '[{"pattern": "(mlp", "levels": 1}]'], "invalid regex"),
    "upgrades with wrong keys": (["--tensor_upgrades", '[{"regex": "mlp", "levels": 1}]'], "exactly the keys"),
    "target below the cheapest": (["--compression_ratio", "0.05"], "can only reach"),
    "target above the richest": (["--compression_ratio", "1.5"], "can only reach"),
    "both budgets": (["--compression_ratio", "0.5", "--target_bits", "4"], "exactly one of"),
    "tp and device_map": (["--tensor_parallel", "2", "--device_map", "cuda:0,cuda:1"], "exclusive"),
    "tau_end above tau_start": (["--tau_start", "0.1", "--tau_end", "0.5"], "tau_end"),
    "output name escaping": (["--output_name", "../../escaped.pt"], "plain file name"),
    "zero steps": (["--max_steps", "0"], "max_steps"),
}


@pytest.mark.parametrize("case", sorted(BAD_ARGS))
def test_bad_train_arguments_are_one_line_errors(gate_model_dir, tmp_path, case):
    extra, expect = BAD_ARGS[case]
    one_line_error(_train(gate_model_dir, tmp_path / "out", *extra), expect=expect)
    assert not (tmp_path / "escaped.pt").exists()


def test_seq_len_longer_than_the_data(gate_model_dir, tmp_path):
    args = _train(gate_model_dir, tmp_path / "out")
    args[args.index("--seq_len") + 1] = "100"
    one_line_error(args, expect=r"--seq_len 100 is longer than the sequences")


def test_tokens_of_another_tokenizer(gate_model_dir, tmp_path):
    data = tmp_path / "data"
    fileio.torch_save(data / "train_tokens.pt", torch.full((4, 48), 49151, dtype=torch.int64))  # a 49k vocab
    one_line_error(_train(gate_model_dir, tmp_path / "out", data_dir=data), expect="tokenized for another model")


@pytest.mark.parametrize("damage", ["truncated", "empty", "not a tensor"])
def test_corrupt_tokens_file(gate_model_dir, tmp_path, damage):
    data = tmp_path / "data"
    data.mkdir()
    good = (gate_model_dir / "data" / "train_tokens.pt").read_bytes()
    if damage == "truncated":
        (data / "train_tokens.pt").write_bytes(good[: len(good) // 2])
    elif damage == "empty":
        (data / "train_tokens.pt").write_bytes(b"")
    else:
        fileio.torch_save(data / "train_tokens.pt", {"x": 1})
    line = one_line_error(_train(gate_model_dir, tmp_path / "out", data_dir=data), expect="tokens file")
    assert str(data / "train_tokens.pt") in line


@pytest.mark.parametrize("fmt", ["gguf", "dat"])
def test_corrupt_imatrix(gate_model_dir, tmp_path, fmt):
    import numpy as np

    from voodoo_quant.gguf.imatrix import Entry, Imatrix

    im = Imatrix({"blk.0.ffn_down.weight": Entry(np.ones(512, np.float32), np.array([8]))}, ["x"], 1, 8)
    p = tmp_path / f"imatrix.{fmt}"
    (im.save_gguf if fmt == "gguf" else im.save_dat)(p)
    p.write_bytes(p.read_bytes()[:-100])
    line = one_line_error(_train(gate_model_dir, tmp_path / "out", "--imatrix", str(p)), expect="imatrix")
    assert str(p) in line


def test_an_imatrix_of_another_model_is_refused(gate_model_dir, tmp_path):
    """An imatrix that covers none of the model's tensors would leave every candidate quantized
    without it while the assignment records it: refused by name."""
    import numpy as np

    from voodoo_quant.gguf.imatrix import Entry, Imatrix

    p = tmp_path / "imatrix.gguf"
    Imatrix({"blk.0.ffn_down_shexp.weight": Entry(np.ones(512, np.float32), np.array([8]))}, ["x"], 1, 8).save_gguf(p)
    line = one_line_error(_train(gate_model_dir, tmp_path / "out", "--imatrix", str(p)),
                          expect="covers none of the model's .* selectable tensors")
    assert str(p) in line


def test_a_corrupt_converted_gguf_is_refused_by_name(gate_model_dir, tmp_path):
    import numpy as np

    from voodoo_quant.core import qtypes as qt
    from voodoo_quant.gguf import converter
    from voodoo_quant.selection.assignment import Assignment, TensorChoice
    from voodoo_quant.tools.export import ExportConfig, export
    from voodoo_quant.training import provenance

    d = gate_model_dir / "model"
    n = "model.layers.0.mlp.down_proj.weight"
    asg = provenance.stamp(Assignment({n: TensorChoice(n, "Q8_0", (256, 512), qt.tensor_bytes("Q8_0", (256, 512)))},
                                      model=str(d)), d)
    bad = tmp_path / "model-f32.gguf"
    w = converter.vendored_gguf().GGUFWriter(bad, "llama")
    w.add_tensor("blk.0.ffn_down.weight", np.zeros((256, 512), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    bad.write_bytes(bad.read_bytes()[:-4096])  # a copy cut short
    with pytest.raises(CorruptFileError, match=f"--converted GGUF {re.escape(str(bad))} is truncated: tensor blk.0"):
        export(ExportConfig(model=d, assignment=asg, output_dir=tmp_path / "out", output_name="x.gguf", converted=bad))


def test_corrupt_journal_names_the_file(gate_model_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "partial.pt").write_bytes(b"PK\x03\x04 not a zip at all")
    line = one_line_error(_train(gate_model_dir, out), expect="journal")
    assert str(out / "partial.pt") in line


# -- security ---------------------------------------------------------------------------------------
class _Payload:
    def __init__(self, target: Path):
        self.target = target

    def __reduce__(self):
        return (os.system, (f"touch {self.target}",))


def test_pickled_payload_is_refused_and_never_runs(gate_model_dir, tmp_path):
    data = tmp_path / "data"
    data.mkdir()
    witness = tmp_path / "pwned"
    with open(data / "train_tokens.pt", "wb") as f:
        pickle.dump(_Payload(witness), f)
    torch.save({"t": _Payload(witness)}, data / "zip.pt", _use_new_zipfile_serialization=True)
    for name in ("train_tokens.pt", "zip.pt"):
        with pytest.raises(CorruptFileError, match="refused by weights_only|corrupt"):
            fileio.torch_load(data / name)
    one_line_error(_train(gate_model_dir, tmp_path / "out", data_dir=data), expect="tokens file")
    assert not witness.exists()


def _package_sources() -> list[tuple[Path, str]]:
    return [(p, p.read_text(encoding="utf-8")) for p in sorted((ROOT / "voodoo_quant").rglob("*.py"))]


def test_no_shell_strings_and_every_torch_load_is_weights_only():
    shell, loads = [], []
    for p, text in _package_sources():
        for i, ln in enumerate(text.splitlines(), 1):
            code = ln.split("#", 1)[0]
            if re.search(r"shell\s*=\s*True|os\.system\(|os\.popen\(|subprocess\.getoutput", code):
                shell.append(f"{p.name}:{i}")
            if re.search(r"torch\.load\(", code) and "weights_only=True" not in code:
                loads.append(f"{p.name}:{i}")
            if re.search(r"\bpickle\.loads?\(", code):
                loads.append(f"{p.name}:{i}")
    assert not shell, shell
    assert not loads, loads


def test_export_output_names_cannot_leave_the_output_dir(gate_model_dir, tmp_path):
    from voodoo_quant.tools.export import ExportConfig

    asg = tmp_path / "a.json"
    asg.write_text("{}")
    for flag, kw in (("--output_name", {"output_name": "../x.gguf"}), ("--model_name", {"model_name": "../../x",
                                                                                     "size_percent": 45})):
        with pytest.raises(ConfigError, match=f"{flag}.*plain file name"):
            ExportConfig(model=gate_model_dir / "model", assignment=asg, output_dir=tmp_path / "o", **kw)


# -- resources ---------------------------------------------------------------------------------------
def test_unwritable_output_dir_fails_before_any_work(gate_model_dir, tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    one_line_error(_train(gate_model_dir, blocker / "out"), expect="not writable")


def test_full_disk_is_refused_up_front_with_the_sizes(tmp_path):
    free = shutil.disk_usage(tmp_path).free
    with pytest.raises(fileio.DiskSpaceError, match=r"needs [\d,.]+ MB, [\d,.]+ MB free"):
        fileio.ensure_free_space(tmp_path / "not-yet", free + (1 << 30), what="the GGUF")
    fileio.ensure_free_space(tmp_path, 1, what="one byte")  # enough space: no error


def test_train_checks_space_for_its_candidate_cache(gate_model_dir, tmp_path):
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer, check_space

    cfg = TrainConfig(model=str(gate_model_dir / "model"), data_dir=str(gate_model_dir / "data"), seq_len=32,
                      compression_ratio=0.8, candidate_types=("Q8_0", "Q4_K"), output_dir=str(tmp_path / "o"))
    tr = Trainer(cfg)
    run = tr.prepare(build=False)
    check_space(cfg, run.plans)  # a few MB: fits
    need = sum(sum(p.sizes) for p in run.plans)
    assert need > 0

    class Huge:  # a plan as large as a 2 EB model: no disk has room for its candidates
        sizes = (1 << 60,)

    with pytest.raises(fileio.DiskSpaceError, match="candidate cache"):
        check_space(cfg, [*run.plans, Huge()])


def test_atomic_outputs_get_ordinary_permissions(tmp_path):
    mask = os.umask(0o022)
    try:
        p = fileio.write_bytes(tmp_path / "x.gguf", b"123")
    finally:
        os.umask(mask)
    assert p.stat().st_mode & 0o777 == 0o644


def test_git_tree_has_no_subprocess_with_string_commands():
    """Every subprocess call passes an argument list (a str first argument would need a shell)."""
    bad = []
    for p, text in _package_sources():
        for m in re.finditer(r"subprocess\.(?:run|Popen|call|check_call|check_output)\(\s*([fr]?[\"'])", text):
            bad.append(f"{p.name}:{text[: m.start()].count(chr(10)) + 1}")
    assert not bad, bad
    assert subprocess.run(["true"]).returncode == 0
