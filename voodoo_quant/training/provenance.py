"""What produced an assignment, recorded by training and checked by export.

The exactness contract ("what the gates optimize is what the runtime serves") holds only when
export quantizes the *same* float weights with the *same* imatrix through the *same* libggml as
the training candidates. An assignment therefore records

- ``weights_sha256``: a content hash of the base weights the candidates were quantized from:
  sha256 over every selected tensor, in GGUF-name order, of its name, its GGUF matrix shape and
  its float32 bytes *as they lie in the GGUF* (``layout.to_gguf(W)``, which is the converter's
  F32 tensor, proved per architecture in ``tests/test_export.py``). Training hashes the
  matrices it quantizes; export hashes the converter's F32 tensors it is about to quantize.
- ``imatrix`` / ``imatrix_sha256``: the imatrix file (absolute path) and its sha256;
- ``ggml_version``: the libggml-base that quantized the candidates (version and commit);
- ``menus``: the requested candidate types per role (each tensor's own menu is in its choice).

A mismatch is refused with one line naming both values (:class:`ProvenanceMismatchError`);
``--allow_mismatch`` (``allow_mismatch=True``) downgrades it to a warning for experts.
"""

from __future__ import annotations

import hashlib
import json
import logging
from pathlib import Path
from typing import Any, Iterable, Mapping

import numpy as np

from ..candidates.compensate import applies, compensations
from ..candidates.hessian_store import load_hessians
from ..core import ggml
from ..core.errors import ConfigError
from ..core.fileio import sha256_file
from ..gguf import imatrix as im
from ..gguf.layout import find_layout, model_layouts
from ..student.build import selectable_weights

log = logging.getLogger(__name__)

OVERRIDE_FLAG = "--allow_mismatch"


class ProvenanceMismatchError(ConfigError):
    """An export input differs from what the assignment was trained with."""


def _update(h, name: str, m: np.ndarray) -> None:
    m = np.ascontiguousarray(m, dtype="<f4")
    h.update(json.dumps([name, list(m.shape)]).encode())
    h.update(memoryview(m).cast("B"))


def weights_sha256(matrices: Iterable[tuple[str, np.ndarray]]) -> str:
    """sha256 over (name, shape, float32 bytes) of every matrix, in name order."""
    items = sorted(matrices, key=lambda kv: kv[0])
    h = hashlib.sha256(b"voodoo-weights-v1")
    seen = set()
    for name, m in items:
        if name in seen:
            raise ConfigError(f"internal: tensor {name} hashed twice")
        seen.add(name)
        _update(h, name, m)
    return h.hexdigest()


def plan_key(plan) -> str:
    return plan.gguf_name or plan.name


def plans_weights_sha256(plans: Iterable, weights: Mapping[str, Any]) -> str:
    """The hash of the planned tensors' GGUF-layout float32 matrices (what the candidates are
    quantized from). `weights`: HF name -> float tensor, before any cast to the training dtype.
    One matrix in memory at a time."""
    h = hashlib.sha256(b"voodoo-weights-v1")
    for plan in sorted(plans, key=plan_key):
        _update(h, plan_key(plan), plan.layout.to_gguf(weights[plan.name]))
    return h.hexdigest()


class _Read:
    """name -> the float tensor a skeleton's checkpoint reader gives (one at a time)."""

    def __init__(self, reader, shapes):
        self.reader, self.shapes = reader, shapes

    def __getitem__(self, name: str):
        return self.reader.get(name, self.shapes[name])


def model_weights_sha256(model, plans: Iterable) -> str:
    """The weights hash of a loaded model, or of a skeleton (tensor-parallel sharded loading:
    parameters on ``meta``) through its checkpoint reader: the same bytes either way."""
    plans = list(plans)
    reader = getattr(model, "voodoo_reader", None)
    if reader is not None:
        return plans_weights_sha256(plans, _Read(reader, {p.name: tuple(p.shape) for p in plans}))
    weights = {n: w for n, (w, _) in selectable_weights(model).items()}
    return plans_weights_sha256(plans, weights)


def ggml_version() -> str:
    """The libggml-base the quantizer runs on, as it reports itself."""
    lib = ggml.lib()
    return f"ggml {lib.version} (commit {lib.commit})"


def menus_record(menus) -> dict[str, list[str]]:
    """The requested candidate types per role of a ``MenuConfig``."""
    return {role: list(menus.types_for(role)) for role in ("attention", "other")}


def run_record(cfg, plans, base_model, imatrix_sha256: str | None, budget=None) -> dict[str, Any]:
    """The provenance fields of an :class:`~voodoo_quant.selection.assignment.Assignment` made by a run
    (computed once, in ``Trainer.prepare``, from the float32 base weights)."""
    return {
        "imatrix": str(Path(cfg.imatrix).resolve()) if cfg.imatrix else None,
        "imatrix_sha256": imatrix_sha256,
        "weights_sha256": model_weights_sha256(base_model, plans),
        "ggml_version": ggml_version(),
        "menus": menus_record(cfg.menus),
        "base_checkpoint": str(Path(cfg.base_checkpoint).resolve()) if cfg.base_checkpoint else None,
        # quantizable tensors no candidate covers, as the budget counted them: {GGUF name: [type, bytes]}
        "fixed": {n: [t, b] for n, t, b in getattr(budget, "fixed", ())},
    }


def refuse_or_warn(message: str, allow: bool) -> None:
    """Raise the one-line mismatch, or (with the override) log it and go on."""
    if allow:
        log.warning("%s (%s given: exporting anyway)", message, OVERRIDE_FLAG)
        return
    raise ProvenanceMismatchError(f"{message}; pass {OVERRIDE_FLAG} to export anyway")


# -- export's checks (cheap ones before the converter runs, the weights hash right after) --------

def check_recorded(asg, *, source: str, allow: bool) -> None:
    """Refuse an assignment that records no provenance, or whose libggml disagrees. (A type may be
    off its tensor's menu: the never-worse guarantee can pick a stock recipe's type; export checks
    instead that each tensor's recorded bytes are what its type gives, see ``tools/export.py``.)"""
    missing = asg.missing_provenance()
    if missing:
        refuse_or_warn(
            f"{source}: assignment (format {asg.format_version}) records no {', '.join(missing)}: it was written "
            "before provenance was recorded, so export cannot check what its candidates were quantized from; "
            "retrain it", allow)
    if asg.ggml_version:
        now = ggml_version()
        if now != asg.ggml_version:
            refuse_or_warn(f"libggml mismatch: the candidates were quantized by {asg.ggml_version}, "
                           f"this export would quantize with {now}", allow)


def resolve_imatrix(asg, given: Any, *, allow: bool):
    """The imatrix export must quantize with: `given` (a path or a loaded Imatrix) when it is the
    one the assignment records, else the recorded file; None when training used none.

    Loads (and so validates, naming the file) a path before comparing hashes."""
    rec_path, rec_sha = asg.imatrix, asg.imatrix_sha256
    if given is None:
        if rec_path is None and rec_sha is None:
            return None
        p = Path(rec_path) if rec_path else None
        if p is None or not p.is_file():
            refuse_or_warn(f"imatrix missing: the assignment was trained with imatrix {rec_path} (sha256 {rec_sha}), "
                           "which no longer exists; pass --imatrix with that file", allow)
            return None
        given, what = p, f"the recorded imatrix {p}"
    else:
        what = f"--imatrix {getattr(given, 'source', None) or given}"
    loaded = im.load(given) if isinstance(given, (str, Path)) else given
    got = getattr(loaded, "sha256", None)
    if rec_sha is None:
        refuse_or_warn(f"imatrix mismatch: the assignment was trained without an imatrix, {what} (sha256 {got}) "
                       "would quantize with one", allow)
    elif got != rec_sha:
        refuse_or_warn(f"imatrix mismatch: the assignment was trained with {rec_path} (sha256 {rec_sha}), "
                       f"{what} has sha256 {got}", allow)
    return loaded


def compensated_tensors(asg) -> list[str]:
    """HF names of the assignment's tensors whose bytes are error-compensated, so that export needs
    the Hessians file for them: those it records as compensated, and in an assignment that predates
    the per-tensor record (``compensated`` None) every quantized one of a compensated run. A tensor
    recorded plain (a guarantee reference's off-menu type) or a float type never is."""
    if not asg.compensation:
        return []
    return sorted(t.name for t in asg.tensors.values() if t.compensated is not False and applies(t.qtype))


def resolve_compensation(asg, *, allow: bool) -> dict:
    """HF tensor name → the :class:`~voodoo_quant.candidates.compensate.Compensation` its candidates were
    quantized with (``--error_compensation``), from the Hessians file the assignment records,
    checked by its sha256; {} when training used none, or when none of the tensors it selects is
    compensated (:func:`compensated_tensors`: the file is then neither read nor needed). A missing
    file, or one without the Hessian of a tensor recorded as compensated, is refused even with the
    override: without it the trained bytes cannot be written."""
    rec = asg.compensation
    need = compensated_tensors(asg)
    if not need:
        if rec:
            log.info("no selected tensor is error-compensated: the Hessians file %s is not read", rec.get("hessians"))
        return {}
    p = Path(str(rec.get("hessians", "")))
    if not p.is_file():
        raise ProvenanceMismatchError(
            f"Hessians missing: the assignment was trained with --error_compensation {rec.get('method')} from {p}, "
            f"which no longer exists; the candidates of its {len(need)} compensated tensor(s) (e.g. {need[0]}) "
            "cannot be reproduced without it")
    got = sha256_file(p)
    if got != rec.get("sha256"):
        refuse_or_warn(f"Hessians mismatch: the assignment was trained with {p} (sha256 {rec.get('sha256')}), "
                       f"the file now has sha256 {got}", allow)
    # an assignment recorded before the sweep was a choice was made with "requant"
    comps = compensations(load_hessians(p), float(rec["damp"]), str(rec.get("sweep", "requant")))
    lacking = sorted(t.name for t in asg.tensors.values() if t.compensated and t.name not in comps)
    if lacking:
        raise ProvenanceMismatchError(
            f"Hessians incomplete: the assignment records {len(lacking)} tensor(s) as compensated that {p} holds "
            f"no Hessian for (e.g. {lacking[0]}); their candidates cannot be reproduced without it")
    return comps


def check_fixed(asg, fixed: Mapping[str, str], *, allow: bool) -> None:
    """Refuse when export would write other not-covered tensors than the budget counted."""
    if asg.fixed is None:
        return
    rec = {n: t for n, (t, _) in asg.fixed.items()}
    if rec != dict(fixed):
        diff = sorted(set(rec.items()) ^ set(fixed.items()))
        refuse_or_warn(f"fixed tensors mismatch: training counted {len(rec)} tensor(s) no candidate covers, export "
                       f"finds {len(fixed)} (first difference: {diff[0][0]} {diff[0][1]})", allow)


def check_weights(asg, actual: str, *, model: Path, base_checkpoint: Path | None, allow: bool) -> None:
    """Refuse when the weights about to be quantized are not the ones the candidates came from."""
    if asg.weights_sha256 is None or actual == asg.weights_sha256:
        return
    given = f"{model}" + (f" with --base_checkpoint {base_checkpoint}" if base_checkpoint else "")
    trained = f" (trained with --base_checkpoint {asg.base_checkpoint})" if asg.base_checkpoint else ""
    refuse_or_warn(f"base weights mismatch: the assignment was trained on weights with sha256 {asg.weights_sha256}"
                   f"{trained}, {given} has sha256 {actual}", allow)


def stamp(asg, model_dir: str | Path, *, imatrix: str | Path | None = None):
    """A copy of a hand-made assignment (tests, benchmarks) with the provenance training would
    have recorded: the hash of `model_dir`'s weights as the converter lays them out, this
    libggml, the menus its types span and `imatrix` (path + sha256)."""
    import dataclasses

    from safetensors import safe_open

    model_dir = Path(model_dir)
    layouts = model_layouts(model_dir)
    wanted = {}
    for t in asg.tensors.values():
        lay = find_layout(layouts, t.name)
        if lay is None:
            raise ConfigError(f"{t.name} has no exact GGUF counterpart in {model_dir}")
        wanted[lay.hf_name] = lay
    mats = []
    for f in sorted(model_dir.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as st:
            for k in st.keys():
                if k in wanted:
                    mats.append((wanted[k].gguf_name, wanted[k].to_gguf(st.get_tensor(k))))
    if len(mats) != len(wanted):
        raise ConfigError(f"{model_dir}: {len(wanted) - len(mats)} assignment tensor(s) not in its safetensors")
    types = sorted({t.qtype for t in asg.tensors.values()})
    im = Path(imatrix).resolve() if imatrix is not None else None
    return dataclasses.replace(
        asg, weights_sha256=weights_sha256(mats), ggml_version=ggml_version(),
        menus=asg.menus or {"attention": types, "other": types},
        imatrix=str(im) if im else None, imatrix_sha256=sha256_file(im) if im else None,
    )
