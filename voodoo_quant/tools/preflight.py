"""What ``voodoo quantize`` checks before any long work: each failure is one clear error.

- the model: its config loads and its architecture plans (on the ``meta`` device: no weights);
- the text: every input exists, is readable UTF-8 and holds text (hashed here: the data step's key);
- the sizes: each within what the menus can reach on this model, with that range in the message;
- the stock tools (``llama-quantize``, ``llama-perplexity``) and the converter script;
- the disk: room for what is still to be written under ``output_dir`` and in the candidate cache;
- ``output_dir`` is writable.
"""

from __future__ import annotations

import json
import logging
import math
import os
from dataclasses import dataclass
from pathlib import Path

from ..arch import adapter_for
from ..candidates.cache import default_root
from ..core import envs, fileio, paths
from ..core import qtypes as qt
from ..core.errors import ConfigError
from ..gguf.converter import vendored_gguf
from ..model.modeling import load_config, resolve_text_class, source_identity
from ..student.build import IdentityLayout, converter_layouts, plan_model, selectable_weights
from .data import DataInputError, expand_input, read_documents

# llama-imatrix records no vector for these (tools/imatrix/imatrix.cpp; tools/calibrate.py).
_NOT_RECORDED = ("output.weight", "token_embd.weight")


@dataclass
class Preflight:
    source_sha: str
    text_hashes: list[list[str]]  # [path, sha256] per input file
    eval_hashes: list[list[str]]
    workers: int  # threads of the stock tools
    q8_bytes: int
    min_bytes: int
    max_bytes: int
    n_params: int
    license: str | None
    base_model: str | None


def _hash_texts(inputs: list[str], glob: str) -> list[list[str]]:
    files = [f for item in inputs for f in expand_input(item, glob)]
    docs, sources = read_documents(files, "text")  # reads every file: unreadable / non-UTF-8 text fails here
    if inputs and not docs:
        raise DataInputError(f"the text inputs {', '.join(inputs)} hold no text (every file is empty)")
    return [[s["path"], s["sha256"]] for s in sources]


def source_sha(src: Path, work: Path) -> str:
    """The source's content hash (modeling.source_identity), remembered by its files' stamps so
    that a rerun does not hash a large model again."""
    files = [src] if src.is_file() else sorted(f for f in src.iterdir() if f.is_file())
    stamp = [[str(f.resolve()), f.stat().st_size, f.stat().st_mtime_ns] for f in files]
    memo = work / "manifests" / "source.json"
    if memo.is_file():
        try:
            d = json.loads(memo.read_text())
            if d.get("stamp") == stamp:
                return d["sha256"]
        except (json.JSONDecodeError, KeyError):
            pass
    sha = source_identity(src).sha256
    fileio.write_json(memo, {"stamp": stamp, "sha256": sha})
    return sha


def _meta_model(src: Path, text_model_class: str | None):
    import torch

    cls, text_cfg = resolve_text_class(load_config(src), text_model_class)
    with torch.device("meta"):
        return cls(text_cfg)


def reachable(src: Path, menus, text_model_class: str | None = None) -> tuple[int, int, int, int, int]:
    """(uniform-Q8_0 bytes, cheapest bytes, richest bytes, parameters, bytes of every candidate) of
    the selectable tensors under `menus`, planned as training plans them (with an imatrix: the
    ladder always makes one)."""
    model = _meta_model(src, text_model_class)
    adapter = adapter_for(model.config)
    layout_for = converter_layouts(str(src)) if src.is_dir() else None
    covered = set()
    for name, (w, _) in selectable_weights(model).items():
        shape = tuple(int(s) for s in w.shape)
        lay = layout_for(name, shape) if layout_for else IdentityLayout(adapter.gguf_name(name), shape)
        if lay is not None and lay.gguf_name and lay.gguf_name not in _NOT_RECORDED:
            covered.add(lay.gguf_name)
    quiet = logging.getLogger("voodoo_quant.student.build")
    level = quiet.level
    quiet.setLevel(logging.ERROR)  # menu notes are the trainer's to log, once per size
    try:
        plans = plan_model(model, adapter, menus, imatrix_names=covered, layout_for=layout_for)
    finally:
        quiet.setLevel(level)
    q8 = sum(qt.resolve_for_row("Q8_0", p.n_per_row).row_bytes(p.n_per_row) * p.rows for p in plans)
    n_params = sum(p.numel() for p in model.parameters())
    return (q8, sum(min(p.sizes) for p in plans), sum(max(p.sizes) for p in plans), n_params,
            sum(sum(p.sizes) for p in plans))


def check_sizes(sizes, q8: int, lo: int, hi: int) -> None:
    bad = [s for s in sizes if not lo <= round(s / 100 * q8) <= hi]
    if bad:
        lo_p, hi_p = 100 * lo / q8, 100 * hi / q8
        raise ConfigError(
            f"--sizes {' '.join(map(str, bad))}: outside what the menus can reach on this model, "
            f"{lo_p:.1f}–{hi_p:.1f} % of uniform Q8_0 (Voodoo{math.ceil(lo_p)}–Voodoo{math.floor(hi_p)}); "
            "choose sizes in that range or widen the menus"
        )


def _source_card_fields(src: Path) -> tuple[str | None, str | None]:
    """(license, base model) the source declares: GGUF general.license / general.base_model.0.*,
    or an HF dir's README front matter."""
    if src.suffix.lower() == ".gguf":
        try:
            r = vendored_gguf().GGUFReader(str(src))
        except Exception:  # noqa: BLE001 - a card field is optional; the model itself loaded above
            return None, None

        def get(k: str):
            f = r.fields.get(k)
            return str(f.contents()) if f is not None else None

        # A hub's base_model is a repo id: general.name is a free-form title, not one.
        base = get("general.base_model.0.repo_url") or get("general.base_model.0.name")
        if base and base.startswith("https://huggingface.co/"):
            base = base[len("https://huggingface.co/"):]
        return get("general.license"), base
    readme = src / "README.md"
    lic = base = None
    if readme.is_file():
        text = readme.read_text(encoding="utf-8", errors="replace")
        if text.startswith("---"):
            for line in text.split("---", 2)[1].splitlines():
                k, _, v = line.partition(":")
                if k.strip() == "license" and v.strip():
                    lic = v.strip()
                if k.strip() == "base_model" and v.strip():
                    base = v.strip()
    return lic, base


def _free_needs(cfg, q8: int, n_params: int, cache_need: int) -> dict[Path, tuple[int, str]]:
    out = cfg.output_dir
    work = out / "work"
    need = 0
    parts = []
    if (Path(cfg.model).suffix.lower() == ".gguf" or cfg.degrid_seed is not None) and not (work / "hf").exists():
        need += 13 * n_params  # base .pt + HF dir (float32 each) + Q8_0 teacher .pt
        parts.append("teacher")
    if not (work / "gguf").exists():
        need += 4 * n_params
        parts.append("F32 reference GGUF")
    for s in cfg.sizes:
        if not any(out.glob(f"{cfg.model_name}.Voodoo{s}_*.gguf")) and not any(out.glob(f"{cfg.model_name}.Voodoo{s}.gguf")):
            need += int(s / 100 * q8) + (4 << 20)
    if cfg.eval:
        need += sum(int(1.1 * q8) for q in cfg.stock if not any((work / "stock").glob(f"*.stock-{q}.gguf")))
    return {out: (need, "the ladder's outputs (" + ", ".join(parts + ["GGUFs"]) + ")"),
            default_root(): (cache_need, "the candidate cache")}


def check_space(needs: dict[Path, tuple[int, str]]) -> None:
    """Refuse when a file system lacks room for what is to be written on it (directories on one
    file system are summed)."""
    by_dev: dict[int, list[tuple[Path, int, str]]] = {}
    for d, (n, what) in needs.items():
        probe = Path(d)
        while not probe.exists() and probe != probe.parent:
            probe = probe.parent
        by_dev.setdefault(os.stat(probe).st_dev, []).append((Path(d), n, what))
    for group in by_dev.values():
        fileio.ensure_free_space(group[0][0], sum(n for _, n, _ in group), what=" and ".join(w for _, _, w in group))


def preflight(cfg) -> Preflight:
    out = cfg.output_dir
    fileio.ensure_writable(out)
    src = Path(cfg.model)
    texts = _hash_texts(cfg.texts, cfg.glob)
    evals = _hash_texts(cfg.eval_texts, cfg.glob) if cfg.eval_texts else []
    q8, lo, hi, n_params, cache_need = reachable(src, cfg.menus, cfg.text_model_class)
    if cfg.target_size is None:  # else the trainer checks the file's size against the menus
        check_sizes(cfg.sizes, q8, lo, hi)
    paths.convert_script()
    if cfg.eval:
        paths.tool_path("llama-quantize")
        paths.tool_path("llama-perplexity")
    check_space(_free_needs(cfg, q8, n_params, cache_need))  # every candidate lands in the cache (cached ones too)
    lic, base = _source_card_fields(src)
    sha = source_sha(src, out / "work")
    return Preflight(sha, texts, evals, cfg.workers or envs.quant_workers(), q8, lo, hi, n_params, lic, base)

