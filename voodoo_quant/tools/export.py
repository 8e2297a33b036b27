"""`voodoo export`: an assignment → one GGUF that stock llama.cpp loads and runs.

Pipeline: llama.cpp's own ``convert_hf_to_gguf.py`` writes an F32 GGUF (metadata, tokenizer,
tensor names and layout: every converter transform already applied), then every tensor is
streamed into the final file: a selected tensor as the bytes libggml-base's quantizer gives for
its assigned type (same imatrix vector as the candidates); a tensor stock ``llama-quantize`` would
quantize that the assignment does not cover (its converter transform is not a permutation, or it
is not a Linear/Embedding weight) as the tool's base type writes it (``BASE_TYPE``, Q8_0: counted
and reported, never silently F32); every other tensor exactly as the converter wrote it.

Before any work the assignment's provenance is checked (``voodoo_quant/training/provenance.py``): the
imatrix (taken from the assignment when ``--imatrix`` is not given), the libggml version, each
tensor's menu; right after conversion, the hash of the float weights about to be quantized. Because the F32 GGUF tensor *is* ``layout.to_gguf(W)`` (proved per
architecture in the tests), the exported bytes are the bytes the training candidate came from.
"""

from __future__ import annotations

import dataclasses
import logging
import re
import shutil
import tempfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from ..candidates.cache import CandidateCache
from ..candidates.compensate import applies, quantize_compensated
from ..core import faults, fileio, ggml
from ..core import qtypes as qt
from ..core.errors import ConfigError, CorruptFileError, QuantizationInputError
from ..gguf import converter, header
from ..gguf.layout import checkpoint_tensors, find_layout, ggml_n_dims, llama_quantize_allows, model_layouts
from ..selection.assignment import Assignment
from ..selection.budget import BASE_TYPE, base_type_for
from ..training import provenance

# llama.cpp's file-type guess (src/llama-model-loader.cpp): the ftype of the dominant type.
_TYPE_TO_FTYPE = {
    "F32": "F32", "F16": "F16", "BF16": "BF16", "Q4_0": "Q4_0", "Q4_1": "Q4_1", "Q5_0": "Q5_0",
    "Q5_1": "Q5_1", "Q8_0": "Q8_0", "Q2_K": "Q2_K", "Q3_K": "Q3_K_M", "Q4_K": "Q4_K_M",
    "Q5_K": "Q5_K_M", "Q6_K": "Q6_K", "TQ1_0": "TQ1_0", "TQ2_0": "TQ2_0", "IQ2_XXS": "IQ2_XXS",
    "IQ2_XS": "IQ2_XS", "IQ2_S": "IQ2_S", "IQ3_XXS": "IQ3_XXS", "IQ1_S": "IQ1_S", "IQ1_M": "IQ1_M",
    "IQ4_NL": "IQ4_NL", "IQ4_XS": "IQ4_XS", "IQ3_S": "IQ3_S",
    # The loader has no guess for MXFP4 (it warns "unknown type" and says F32); the ftype that makes
    # llama-quantize write MXFP4 tensors is MXFP4_MOE (src/llama-quant.cpp), so a file whose
    # dominant type is MXFP4 says that.
    "MXFP4": "MXFP4_MOE",
}
assert set(_TYPE_TO_FTYPE) == set(qt.QTYPES), sorted(set(qt.QTYPES) ^ set(_TYPE_TO_FTYPE))

log = logging.getLogger(__name__)

# GGUF header fields the reader synthesizes, and the one GGUFWriter writes itself.
_SKIP_KEYS = ("GGUF.", "general.architecture")


@dataclass
class ExportConfig:
    model: Path  # HF checkpoint dir (config, tokenizer, safetensors)
    assignment: Path | Assignment
    output_dir: Path
    base_checkpoint: Path | None = None  # a state-dict .pt whose weights replace the safetensors'
    imatrix: Path | Any | None = None  # imatrix file, or a loaded voodoo_quant.gguf.imatrix.Imatrix
    output_name: str | None = None  # file name; default <Model>.Voodoo<NN>_<BADGE>.gguf
    size_percent: int | None = None  # the standard size (Voodoo45 → 45) for the canonical name
    model_name: str | None = None  # <Model> in the name; default: the model dir's name
    overwrite: bool = False
    keep_f32: bool = False  # keep the converter's F32 GGUF beside the output (for checks)
    # the converter's F32 GGUF of `model`, made earlier (a --keep_f32 file, the ladder's reference):
    # read instead of converting again; its selected tensors must hash to the assignment's weights
    converted: Path | None = None
    workers: int | None = None
    allow_mismatch: bool = False  # export even when the provenance checks disagree (experts)

    def __post_init__(self) -> None:
        self.model = Path(self.model)
        self.output_dir = Path(self.output_dir)
        if not (self.model / "config.json").is_file():
            raise ConfigError(f"--model {self.model} is not an HF checkpoint directory (no config.json)")
        if not isinstance(self.assignment, Assignment):
            self.assignment = Path(self.assignment)
            if not self.assignment.is_file():
                raise ConfigError(f"--assignment {self.assignment} does not exist")
        if self.base_checkpoint is not None:
            self.base_checkpoint = Path(self.base_checkpoint)
            if not self.base_checkpoint.is_file():
                raise ConfigError(f"--base_checkpoint {self.base_checkpoint} does not exist")
        if isinstance(self.imatrix, (str, Path)):
            self.imatrix = Path(self.imatrix)
            if not self.imatrix.is_file():
                raise ConfigError(f"--imatrix {self.imatrix} does not exist")
        if self.converted is not None:
            self.converted = Path(self.converted)
            if not self.converted.is_file():
                raise ConfigError(f"--converted {self.converted} does not exist")
            if self.base_checkpoint is not None:
                raise ConfigError("--converted is the conversion of --model's own weights; with --base_checkpoint "
                                  "the weights are another's (leave --converted out)")
            if self.keep_f32:
                raise ConfigError("--keep_f32 keeps the conversion export makes; with --converted it makes none")
        if self.size_percent is not None and not (isinstance(self.size_percent, int) and 0 < self.size_percent <= 400):
            raise ConfigError(f"--size_percent must be a whole percent of Q8_0 in 1..400, got {self.size_percent!r}")
        if self.output_name is None and self.size_percent is None:
            raise ConfigError("give --output_name or --size_percent (for the canonical Voodoo<NN>_<BADGE> name)")
        if self.output_name is not None and not self.output_name.endswith(".gguf"):
            raise ConfigError(f"--output_name {self.output_name!r} must end in .gguf")
        for flag, v in (("--output_name", self.output_name), ("--model_name", self.model_name)):
            if v is not None and not _bare_name(v):
                raise ConfigError(f"{flag} {v!r} must be a plain file name: no directories, it may not leave --output_dir")

    def file_name(self) -> str:
        if self.output_name:
            return self.output_name
        return canonical_name(self.model_name or self.model.name, int(self.size_percent))


@dataclass
class ExportResult:
    path: Path
    nbytes: int  # file size
    bpw: float  # bits per weight over the selected tensors (what the assignment priced)
    file_bpw: float  # bits per weight of every tensor in the file
    tensor_type_file: Path
    f32_gguf: Path | None = None
    types: dict[str, int] = field(default_factory=dict)  # ggml type → tensor count
    # quantizable tensors the assignment does not cover, written as BASE_TYPE would be: name → type
    fixed: dict[str, str] = field(default_factory=dict)
    fixed_bytes: int = 0
    imatrix: str | None = None  # the imatrix file the export quantized with


def _bare_name(name: str) -> bool:
    return bool(name) and name not in (".", "..") and "/" not in name and "\\" not in name and "\0" not in name


def _checkpoint_elements(model: Path) -> int:
    """Number of weights in the checkpoint's safetensors, from their headers alone."""
    return sum(int(np.prod(shape, dtype=np.int64)) for shape in checkpoint_tensors(model).values())


def check_space(cfg: ExportConfig, asg: Assignment, out_path: Path) -> None:
    """Before converting: room for the converter's F32 GGUF (temp dir; none with ``converted``)
    and for the output."""
    n_all = _checkpoint_elements(cfg.model)
    n_sel = sum(int(np.prod(t.shape, dtype=np.int64)) for t in asg.tensors.values())
    if cfg.converted is None:
        tmp_need = 4 * n_all * (2 if cfg.base_checkpoint is not None else 1)  # F32 GGUF (+ safetensors copy)
        fileio.ensure_free_space(tempfile.gettempdir(), tmp_need, what="the converter's temporary F32 GGUF")
    out_need = asg.total_bytes + 4 * max(0, n_all - n_sel) + (1 << 20)  # + unselected F32 tensors, metadata
    fileio.ensure_free_space(out_path.parent, out_need, what=f"the GGUF {out_path.name}")


def canonical_name(model: str, percent: int) -> str:
    """``<Model>.Voodoo<NN>_<BADGE>.gguf``, e.g. ``Qwen3.5-0.8B.Voodoo45_IQ2_M.gguf``; a size
    outside the curated badge table is named by its number alone (``<Model>.Voodoo85.gguf``)."""
    badge = qt.BADGES.get(percent)
    return f"{model}.Voodoo{percent}_{badge}.gguf" if badge else f"{model}.Voodoo{percent}.gguf"


def _hf_dir_with_weights(model: Path, pt: Path, tmp: Path) -> Path:
    """A temporary HF dir: the model's config/tokenizer files + the .pt's weights as safetensors."""
    import torch
    from safetensors.torch import save_file

    out = tmp / model.name
    out.mkdir()
    for f in model.iterdir():
        if f.is_file() and not f.name.endswith(".safetensors") and f.name != "model.safetensors.index.json":
            (out / f.name).symlink_to(f.resolve())
    sd = fileio.torch_load(pt, what="base checkpoint")
    if not isinstance(sd, dict) or not all(isinstance(v, torch.Tensor) for v in sd.values()):
        raise CorruptFileError(f"{pt} is not a state dict of tensors")
    known = checkpoint_tensors(model)
    stripped = {re.sub(r"^model\.language_model\.", "model.", k): k for k in known}
    tensors = {}
    for k, v in sd.items():
        name = k if k in known else stripped.get(k)
        if name is None:
            alt = re.sub(r"^model\.", "model.language_model.", k)
            name = alt if alt in known else None
        if name is None:
            continue  # e.g. a tied lm_head the checkpoint does not store
        if tuple(v.shape) != known[name]:
            raise CorruptFileError(f"{pt}: {k} has shape {tuple(v.shape)}, the model has {known[name]}")
        tensors[name] = v.detach().to("cpu").contiguous()
    missing = sorted(set(known) - set(tensors))
    if missing:
        raise CorruptFileError(f"{pt} lacks {len(missing)} tensor(s) of {model}, e.g. {missing[0]}")
    save_file(tensors, str(out / "model.safetensors"))
    return out


def _selected(asg: Assignment, model_dir: Path) -> tuple[dict[str, str], dict[str, str]]:
    """({GGUF name: ggml type}, {HF name: GGUF name}) of the assignment; missing GGUF names are
    resolved through the layout map."""
    layouts = None
    out: dict[str, str] = {}
    names: dict[str, str] = {}
    for t in asg.tensors.values():
        name = t.gguf_name
        if name is None:
            layouts = layouts if layouts is not None else model_layouts(model_dir)
            lay = find_layout(layouts, t.name)
            if lay is None:
                raise ConfigError(f"assignment tensor {t.name} has no exact GGUF counterpart in {model_dir}")
            name = lay.gguf_name
        out[name] = qt.get(t.qtype).name
        names[t.name] = name
    return out, names


def _ftype(counts: dict[str, int]) -> int:
    dominant = max(counts.items(), key=lambda kv: kv[1])[0]
    return qt.LLAMA_FTYPES[_TYPE_TO_FTYPE[dominant]]


def _copy_kv(reader, writer, gguf) -> None:
    for f in reader.fields.values():
        # the keys export writes itself (from the assignment, not from the file it converts)
        if f.name.startswith(_SKIP_KEYS) or f.name.startswith(("general.file_type", "quantize.imatrix.", "voodoo.")):
            continue
        vtype = f.types[0]
        sub = f.types[-1] if vtype == gguf.GGUFValueType.ARRAY else None
        if vtype == gguf.GGUFValueType.ARRAY and len(f.types) > 2:
            raise CorruptFileError(f"nested GGUF arrays are not supported (key {f.name})")
        writer.add_key_value(f.name, f.contents(), vtype, sub_type=sub)


def _weights_sha256(reader, selected: dict[str, str]) -> str:
    """provenance.weights_sha256 of the converter's F32 tensors the assignment selects."""
    def matrices():
        for t in reader.tensors:
            if t.name in selected:
                shape = tuple(int(s) for s in reversed(t.shape.tolist()))
                yield t.name, np.asarray(t.data, dtype=np.float32).reshape(-1, shape[-1])
    return provenance.weights_sha256(matrices())


def candidate_bytes(cands: CandidateCache, w2: np.ndarray, q: str, vec, comp, want: str | None, *, name: str,
                    lib=None, workers: int | None = None, allow: bool = False) -> bytes:
    """The bytes export writes for tensor `name` (GGUF layout `w2`) in `q`: a compensated
    candidate is read from the candidate cache when its entry's key (matrix, type, imatrix,
    libggml, Hessian digest with damping and sweep version) matches and its bytes are the ones
    training read (`want`, the assignment's sha256 of them; the cache checks its own sha256 too);
    else it is computed again. What is computed must hash to `want` (when recorded), or export
    refuses: training's bytes are written, or none (W' in float32 may round differently on other
    hardware; the cache where training ran holds the bytes)."""
    import hashlib

    if comp is not None and applies(q):
        data = cands.get(CandidateCache.key(w2, q, vec, compensation=comp))
        if data is not None and (want is None or hashlib.sha256(data).hexdigest() == want):
            return data
    data = quantize_compensated(w2, q, vec, comp, lib=lib, name=name, workers=workers)
    got = hashlib.sha256(data).hexdigest() if want is not None else None
    if got != want:
        how = "compensated " if comp is not None and applies(q) else ""
        provenance.refuse_or_warn(
            f"{name}: the {how}{q} bytes computed here have sha256 {got}, training's candidate had {want}; "
            "export on the machine whose candidate cache holds them (VOODOO_CACHE_DIR), or train again here", allow)
    return data


def export(cfg: ExportConfig) -> ExportResult:
    asg = cfg.assignment if isinstance(cfg.assignment, Assignment) else Assignment.load(cfg.assignment)
    source = str(cfg.assignment) if isinstance(cfg.assignment, Path) else "the assignment"
    if not asg.tensors:
        raise ConfigError("the assignment selects no tensor")
    # Provenance first: refuse before minutes of converting (one line naming both values).
    provenance.check_recorded(asg, source=source, allow=cfg.allow_mismatch)
    imat = provenance.resolve_imatrix(asg, cfg.imatrix, allow=cfg.allow_mismatch)
    comps = provenance.resolve_compensation(asg, allow=cfg.allow_mismatch)  # HF name -> Compensation
    if cfg.converted is not None and asg.weights_sha256 is None:  # (refused above unless allowed)
        provenance.refuse_or_warn(f"{source} records no weights hash: --converted {cfg.converted} is used unchecked",
                                  cfg.allow_mismatch)
    if cfg.converted is not None:  # a user's file: checked before gguf-py maps it (its errors name no file)
        header.read_file(cfg.converted, "--converted GGUF")
    out_path = cfg.output_dir / cfg.file_name()
    if out_path.exists() and not cfg.overwrite:
        raise fileio.OutputExistsError(f"{out_path} exists; pass --overwrite to replace it")
    fileio.ensure_writable(cfg.output_dir)
    fileio.remove_stale_temps(cfg.output_dir, (out_path.name,))  # left by an export killed mid-write
    check_space(cfg, asg, out_path)
    gguf = converter.vendored_gguf()
    lib = ggml.lib()

    with tempfile.TemporaryDirectory(prefix="voodoo-export-") as tmpd:
        tmp = Path(tmpd)
        model_dir = cfg.model if cfg.base_checkpoint is None else _hf_dir_with_weights(cfg.model, cfg.base_checkpoint, tmp)
        selected, gguf_names = _selected(asg, cfg.model)
        comp_of = {gguf_names[n]: c for n, c in comps.items() if n in gguf_names}
        cands = CandidateCache()
        f32_path = cfg.converted or converter.convert(model_dir, tmp / "model-f32.gguf", outtype="f32")
        reader = gguf.GGUFReader(f32_path)
        present = {t.name for t in reader.tensors}
        unknown = sorted(set(selected) - present)
        if unknown:
            raise ConfigError(f"assignment names {len(unknown)} tensor(s) not in the converted GGUF, e.g. {unknown[0]}")
        if asg.weights_sha256 is not None:
            provenance.check_weights(asg, _weights_sha256(reader, selected),
                                     model=cfg.converted or cfg.model,
                                     base_checkpoint=cfg.base_checkpoint, allow=cfg.allow_mismatch)

        # Plan every tensor first: the header (tensor infos) precedes the data.
        plan = []  # (reader tensor, shape, qtype or None, bytes, the Compensation of its bytes or None)
        counts: dict[str, int] = {}
        fixed: dict[str, str] = {}
        recorded = {gguf_names[c.name]: c for c in asg.tensors.values()}
        n_sel = n_all = sel_bytes = all_bytes = fixed_bytes = 0
        for t in reader.tensors:
            ne = [int(s) for s in t.shape.tolist()]  # ggml order: ne[0] = row length
            shape = tuple(reversed(ne))  # numpy order
            n = int(np.prod(shape, dtype=np.int64))
            q = selected.get(t.name)
            comp = None
            if q is None and llama_quantize_allows(t.name, ggml_n_dims(ne)):
                # Stock llama-quantize would quantize it; the assignment does not cover it.
                q = fixed[t.name] = base_type_for(shape)
                fixed_bytes += qt.tensor_bytes(q, shape)
            if q is not None and t.name in fixed:
                nbytes = qt.tensor_bytes(q, shape)
            elif q is not None:
                if not llama_quantize_allows(t.name, ggml_n_dims(ne)):
                    raise ConfigError(f"{t.name}: llama-quantize never quantizes this tensor; it cannot take {q}")
                if not qt.get(q).fits(shape[-1]):
                    raise QuantizationInputError(
                        f"{t.name}: row size ({shape[-1]}) is not a multiple of {q} block size ({qt.get(q).block}); "
                        f"llama-quantize would write {qt.resolve_for_row(q, shape[-1]).name}"
                    )
                nbytes = qt.tensor_bytes(q, shape)
                rec = recorded[t.name]
                if rec.nbytes != nbytes:  # a hand-edited type, or an assignment made for other shapes
                    provenance.refuse_or_warn(
                        f"{rec.name}: the assignment records {rec.nbytes:,} bytes for {rec.qtype}, but {q} of "
                        f"{t.name} {list(shape)} is {nbytes:,} bytes", cfg.allow_mismatch)
                n_sel += n
                sel_bytes += nbytes
                # the candidate's compensation; none where training's bytes were plain (a reference's
                # off-menu type: guarantee.py), as the assignment records per tensor, or the type is a float
                comp = comp_of.get(t.name) if rec.compensated is not False and applies(q) else None
            else:
                nbytes = int(t.n_bytes)
            name_t = q or t.tensor_type.name
            if q is not None or name_t not in ("F32",):
                counts[name_t] = counts.get(name_t, 0) + 1
            n_all += n
            all_bytes += nbytes
            plan.append((t, shape, q, nbytes, comp))

        provenance.check_fixed(asg, fixed, allow=cfg.allow_mismatch)
        # the GGUF says "error-compensated" only of a file some of whose bytes are (an assignment of a
        # compensated run may select no compensated tensor: export then writes stock llama-quantize's bytes)
        n_comp = sum(comp is not None for *_, comp in plan)
        file_bpw = 8.0 * all_bytes / max(1, n_all)
        bpw = 8.0 * sel_bytes / max(1, n_sel)

        def write(path: Path) -> None:
            w = gguf.GGUFWriter(path, reader.fields["general.architecture"].contents())
            _copy_kv(reader, w, gguf)
            w.add_file_type(_ftype(counts))
            if imat is not None:
                # tools/quantize/quantize.cpp writes these four when given an imatrix.
                src = getattr(imat, "source", None) or asg.imatrix
                w.add_string("quantize.imatrix.file", str(src)[:127])
                if getattr(imat, "datasets", None):
                    w.add_string("quantize.imatrix.dataset", imat.datasets[0][:127])
                w.add_int32("quantize.imatrix.entries_count", len(imat.entries))
                if getattr(imat, "chunk_count", 0) > 0:
                    w.add_int32("quantize.imatrix.chunks_count", int(imat.chunk_count))
            w.add_float32("voodoo.bpw", float(bpw))
            w.add_float32("voodoo.file_bpw", float(file_bpw))
            if n_comp:
                w.add_string("voodoo.error_compensation", str(asg.compensation.get("method")))
            if cfg.size_percent is not None:
                w.add_uint32("voodoo.size_percent", int(cfg.size_percent))
                if cfg.size_percent in qt.BADGES:
                    w.add_string("voodoo.badge", qt.BADGES[cfg.size_percent])
            for t, shape, q, nbytes, _ in plan:
                if q is None:
                    w.add_tensor_info(t.name, t.data.shape, t.data.dtype, nbytes, raw_dtype=t.tensor_type)
                else:
                    # byte shape keeps every leading dim: a 3-D expert tensor stays 3-D in the header
                    byte_shape = (*shape[:-1], qt.get(q).row_bytes(shape[-1]))
                    w.add_tensor_info(t.name, byte_shape, np.dtype(np.uint8), nbytes,
                                      raw_dtype=gguf.GGMLQuantizationType(qt.get(q).id))
            w.write_header_to_file()
            w.write_kv_data_to_file()
            w.write_ti_data_to_file()
            for t, shape, q, nbytes, comp in plan:  # streamed: one tensor in memory at a time
                faults.hit("export:tensor")
                if q is None:
                    w.write_tensor_data(np.asarray(t.data))
                    continue
                if t.tensor_type != gguf.GGMLQuantizationType.F32:
                    raise CorruptFileError(f"{t.name}: converter wrote {t.tensor_type.name}, expected F32")
                w2 = np.ascontiguousarray(np.asarray(t.data, dtype=np.float32).reshape(-1, shape[-1]))
                # Q8_0 and F16 (the base type and its fallback) take no imatrix (quantize_q8_0 ignores it)
                vec = None if imat is None or t.name in fixed or qt.get(q).is_float else imat.get_vector(t.name, shape[-1])
                want = None if t.name in fixed else recorded[t.name].sha256
                data = candidate_bytes(cands, w2, q, vec, comp, want, name=t.name, lib=lib, workers=cfg.workers,
                                       allow=cfg.allow_mismatch)
                w.write_tensor_data(np.frombuffer(data, dtype=np.uint8))
            w.close()

        fileio.write_with(out_path, write, overwrite=cfg.overwrite)
        f32_keep = None
        if cfg.keep_f32:
            f32_keep = out_path.with_name(out_path.stem + ".f32.gguf")
            # atomic: the temp dir may lie on another file system, where a move is a copy
            fileio.write_with(f32_keep, lambda tmp: shutil.move(str(f32_path), tmp))
        del reader

    ttf = out_path.with_name(out_path.stem + ".tensor-types.txt")
    asg_named = dataclasses.replace(
        asg, tensors={k: dataclasses.replace(v, gguf_name=gguf_names[v.name]) for k, v in asg.tensors.items()},
    ) if any(v.gguf_name is None for v in asg.tensors.values()) else asg
    asg_named.save_tensor_types(ttf)
    if fixed:
        log.info("%d quantizable tensor(s) the assignment does not cover were written as llama-quantize's base "
                 "type %s would: %s", len(fixed), BASE_TYPE, ", ".join(sorted(fixed)[:4]))
    src = getattr(imat, "source", None)
    return ExportResult(
        path=out_path, nbytes=out_path.stat().st_size, bpw=bpw, file_bpw=file_bpw,
        tensor_type_file=ttf, f32_gguf=f32_keep, types=dict(sorted(counts.items())),
        fixed=dict(sorted(fixed.items())), fixed_bytes=fixed_bytes, imatrix=str(src) if src else None,
    )

