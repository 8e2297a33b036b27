"""AutoRound (Intel's ``auto-round``, PyPI) as a peer in the quality benchmark: its GGUF export
beside our files, on the same model, calibration text and eval.

    make bench-peer-deps                                           # pip install -e ".[peer]"
    .venv/bin/python bench/autoround.py run                        # gguf:q4_k_m gguf:q3_k_m gguf:q2_k_s, iters=0
    .venv/bin/python bench/autoround.py run --formats gguf:q4_k_s --tuned gguf:q3_k_m --iters 200
    .venv/bin/python bench/quality.py report                       # its rows beside ours

``run`` takes the settings of ``bench/quality.py run`` that a row's digest holds (model, texts,
``--seq_len``, ``--calib_sequences``, ``--ctx``, ``--chunks``; the same defaults) and, for each
format, runs AutoRound's GGUF export on the benchmark's float teacher (the ladder's: the
de-gridded HF checkpoint by default) with ``iters=0`` (its optimized RTN, which weighs rounding
by an importance matrix of the calibration text), or ``--tuned`` at one format with ``--iters``.
Each file is scored by the benchmark's own code (``quality.Bench``: the same reference, eval
bases, stock ``llama-perplexity --kl-divergence``, row and cost lines) into the same results
file; its digest's ``file`` is ``{"method": "autoround", "format", "iters"}`` and it also holds
the auto-round version, ``--amp`` and the device, so a rerun skips rows present. It must not run
while ``quality.py run`` writes the same results file.

Calibration: the benchmark's calibration text (``quality_texts``: pieces of ~4000 characters,
one JSON line each). AutoRound tokenizes each record with truncation at ``seqlen``, drops one
shorter than ``seqlen`` (and one whose last token fills over half of it), shuffles and keeps
``nsamples``. :func:`calib_records` therefore writes exactly ``--calib_sequences`` records, in
the text's order, each at least ``--seq_len`` tokens by AutoRound's own tokenization (a short
piece is joined to the next); the worker counts what AutoRound's own loader kept and fails the
file unless it is all of them. Both counts are logged and recorded with the row.

AutoRound runs in a child process (``quantize``), its log in ``<work>/autoround/``: the row
records its wall time, peak RSS, the dtype it quantized in (on CPU it casts a float32 model to
bfloat16 unless ``amp=False``; this driver passes ``amp=False`` unless ``--amp``) and every
tensor whose type differs from what stock ``llama-quantize`` writes for the same ftype
(``voodoo_quant.gguf.recipes``). auto-round imports ``gguf`` and ``sentencepiece`` for its GGUF
export without declaring them; both are in the ``peer`` extra.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
import quality  # noqa: E402  (puts the repository on sys.path)
import quality_rows as store  # noqa: E402

from voodoo_quant.core.errors import VoodooError  # noqa: E402

ROOT = quality.ROOT
PIN = "auto-round==0.16.1"  # pyproject.toml's `peer` extra
INSTALL = f'make bench-peer-deps (.venv/bin/pip install -e ".[peer]": {PIN})'
DEFAULT_FORMATS = ("gguf:q4_k_m", "gguf:q3_k_m", "gguf:q2_k_s")
# auto-round 0.16.1 export/formats/backends/gguf.py GGUFFormat.support_schemes, without q2_k_mixed
# (MoE models only; others fall back to q2_k_s).
FORMATS = ("q4_0", "q4_1", "q5_0", "q5_1", "q2_k_s", "q3_k_s", "q3_k_m", "q3_k_l", "q4_k_s", "q4_k_m", "q5_k_s",
           "q5_k_m", "q6_k", "q8_0")
RECORDS_RULE = 1  # calib_records' grouping: part of the digest


class PeerError(VoodooError):
    """AutoRound is missing, failed, or did not use the calibration records it was given."""


def fmt_name(fmt: str) -> str:
    """``gguf:q4_k_m`` or ``q4_k_m`` → ``q4_k_m``, checked against the formats auto-round exports."""
    name = fmt.lower().removeprefix("gguf:")
    if name not in FORMATS:
        raise SystemExit(f"format {fmt!r}: auto-round's GGUF formats are {', '.join('gguf:' + f for f in FORMATS)}")
    return name


def autoround_version() -> str:
    """The installed auto-round's version; a :class:`PeerError` saying how to install it."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        v = version("auto-round")
    except PackageNotFoundError:
        raise PeerError(f"auto-round is not installed: {INSTALL}") from None
    missing = [m for m in ("gguf", "sentencepiece") if importlib.util.find_spec(m) is None]
    if missing:
        raise PeerError(f"auto-round's GGUF export needs {' and '.join(missing)}, which it does not declare: {INSTALL}")
    return v


@dataclass(frozen=True)
class PeerItem:
    """One AutoRound file: a GGUF format at an iteration count (0: optimized RTN)."""

    format: str  # q4_k_m
    iters: int = 0
    method: str = "autoround"
    trained = False  # not one of ours: no train settings, no candidate cache

    @property
    def label(self) -> str:
        return f"autoround-{self.format}" + (f"-iters{self.iters}" if self.iters else "")

    def key(self) -> dict[str, Any]:
        return {"method": self.method, "format": self.format, "iters": self.iters}


# -- calibration records -------------------------------------------------------------------------

def autoround_keeps(tokenizer, text: str, seq_len: int) -> bool:
    """Whether AutoRound keeps a record (auto_round/calib_dataset.py: get_local_dataset strips its
    end, get_tokenizer_function truncates at seqlen, _get_dataset_impl.filter_func drops one shorter
    than seqlen or whose last token is over half of it)."""
    ids = tokenizer(text.rstrip(), truncation=True, max_length=seq_len)["input_ids"]
    return len(ids) >= seq_len and ids[:seq_len].count(ids[seq_len - 1]) <= seq_len // 2


def calib_records(pieces: list[str], tokenizer, seq_len: int, n: int) -> tuple[list[str], dict[str, int]]:
    """`n` records AutoRound keeps, from `pieces` in order: a piece too short is joined to the
    next (a record AutoRound drops for repetition is skipped). Raises when the text runs out."""
    out: list[str] = []
    cur: list[str] = []
    joined = skipped = used = 0
    for p in pieces:
        if len(out) == n:
            break
        used += 1
        cur.append(p)
        text = "\n".join(cur).rstrip()
        if autoround_keeps(tokenizer, text, seq_len):
            out.append(text)
            joined += len(cur) > 1
            cur = []
        elif len(tokenizer(text, truncation=True, max_length=seq_len)["input_ids"]) >= seq_len:
            skipped += len(cur)  # long enough, but AutoRound's repetition filter drops it
            cur = []
    if len(out) < n:
        raise PeerError(f"the calibration text makes {len(out)} records of {seq_len} tokens, not {n}: "
                        "give a longer text (--calib_chars) or fewer --calib_sequences")
    short = sum(not autoround_keeps(tokenizer, p, seq_len) for p in pieces)
    return out, {"records": len(out), "pieces_used": used, "pieces": len(pieces), "joined": joined,
                 "skipped_repetitive": skipped, "pieces_autoround_would_drop": short}


def write_records(calib: Path, tokenizer, seq_len: int, n: int, out: Path) -> dict[str, int]:
    """The AutoRound dataset (.jsonl, {"text": ...} per line) from the benchmark's calibration
    JSONL; returns :func:`calib_records`' counts."""
    from voodoo_quant.core import fileio

    pieces = [json.loads(ln)["text"] for ln in calib.read_text(encoding="utf-8").splitlines() if ln.strip()]
    records, stats = calib_records(pieces, tokenizer, seq_len, n)
    fileio.write_text(out, "".join(json.dumps({"text": r}, ensure_ascii=False) + "\n" for r in records))
    return stats


# -- the driver ----------------------------------------------------------------------------------

class Peer(quality.Bench):
    """``quality.Bench`` with AutoRound's files for items: the same texts, reference, eval bases,
    rows and cost lines."""

    shared_steps = ("make-teacher", "reference")  # no imatrix, no candidates: AutoRound makes its own

    def __init__(self, cfg: quality.BenchConfig, command: str = "", *, formats=DEFAULT_FORMATS,
                 tuned: str | None = None, iters: int = 200, amp: bool = False, version: str | None = None, **kw):
        super().__init__(cfg, command, **kw)
        self.formats = tuple(dict.fromkeys(fmt_name(f) for f in formats))
        self.tuned = fmt_name(tuned) if tuned else None
        if self.tuned and iters < 1:
            raise SystemExit(f"--iters {iters}: the tuned mode needs at least one")
        self.iters, self.amp = iters, amp
        self.version = version or autoround_version()
        self.versions = {**self.versions, "auto-round": self.version}
        self.dir = cfg.work / "autoround"
        self.records: tuple[Path, dict[str, int]] | None = None
        self.made: dict[str, Any] = {}  # the last file's facts, for its rows

    def items(self, sizes) -> list[PeerItem]:
        return [PeerItem(f) for f in self.formats] + ([PeerItem(self.tuned, self.iters)] if self.tuned else [])

    def row_config(self, item, text: str) -> dict[str, Any]:
        d = super().row_config(item, text)
        d["auto-round"] = {"version": self.version, "amp": self.amp, "device": self.cfg.device, "records": RECORDS_RULE}
        return d

    def setup(self, ladder, item, texts: list[str]) -> None:
        """The float teacher, the F32 reference and the eval bases (no imatrix, no candidates)."""
        if "shared" not in self.ready:
            ladder.teacher()
            ladder.reference_gguf()
            self.ready.add("shared")
        for text in texts:
            self.base(ladder, text)

    def dataset(self, ladder) -> tuple[Path, dict[str, int]]:
        """AutoRound's calibration records, written once per process."""
        if self.records is None:
            from transformers import AutoTokenizer

            c = self.cfg
            out = self.dir / f"calib-{'+'.join(c.calib)}-{c.seq_len}x{c.calib_sequences}.jsonl"
            stats = write_records(self.texts.calib, AutoTokenizer.from_pretrained(ladder.teacher_hf), c.seq_len,
                                  c.calib_sequences, out)
            self.log(f"AutoRound calibration: {stats['records']} records from the first {stats['pieces_used']} of "
                     f"{stats['pieces']} pieces of {self.texts.calib.name} ({stats['joined']} joined from shorter "
                     f"pieces, {stats['skipped_repetitive']} skipped as repetitive), each >= {c.seq_len} tokens by "
                     f"AutoRound's own tokenization: none dropped (of the file as it is, "
                     f"{stats['pieces_autoround_would_drop']} of {stats['pieces']} would be)")
            self.records = (out, stats)
        return self.records

    def make(self, ladder, item: PeerItem) -> tuple[Path, list[Path], dict[str, float]]:
        """AutoRound's GGUF of the teacher, made in a child process; its facts kept for the rows."""
        from voodoo_quant.core import fileio

        c = self.cfg
        records, stats = self.dataset(ladder)
        if any(ch in str(records) for ch in " ,:"):  # calibration/llm.py strips spaces; calib_dataset splits on , and :
            raise PeerError(f"AutoRound cannot read a dataset path holding a space, comma or colon: {records} (--work)")
        out = self.dir / item.label
        shutil.rmtree(out, ignore_errors=True)
        result, log = out / "result.json", self.dir / f"{item.label}.log"
        cmd = [sys.executable, str(Path(__file__).resolve()), "quantize", "--model", str(ladder.teacher_hf),
               "--format", item.format, "--iters", str(item.iters), "--dataset", str(records), "--seq_len",
               str(c.seq_len), "--nsamples", str(c.calib_sequences), "--device", c.device, "--out", str(out),
               "--result", str(result)] + (["--amp"] if self.amp else []) + (
               ["--threads", str(c.threads)] if c.threads else [])
        self.log(f"{item.label}: AutoRound {self.version} (log: {log})")
        with open(log, "w", encoding="utf-8") as fh:
            rc = subprocess.run(cmd, stdout=fh, stderr=subprocess.STDOUT).returncode
        if rc != 0 or not result.is_file():
            tail = log.read_text(encoding="utf-8", errors="replace")[-1500:]
            raise PeerError(f"AutoRound {item.label} failed (exit {rc}); the end of {log}:\n{tail}")
        r = fileio.read_json(result, what="AutoRound result")
        if not r["loads"] or any(n != stats["records"] for n in r["loads"]):
            raise PeerError(f"AutoRound {item.label} loaded {r['loads'] or 'no'} calibration samples of the "
                            f"{stats['records']} records in {records} (see {log}): it must use every one")
        f = self.dir / f"{c.name}.{item.label}.gguf"
        os.replace(r["gguf"], f)
        shutil.rmtree(out, ignore_errors=True)
        diff = types_vs_stock(f, item.format)
        self.log(f"{item.label}: {r['seconds']:.0f} s, peak RSS {r['peak_rss_mb']['self']:.0f} MB, quantized in "
                 f"{r['dtype']}, calibration samples loaded {r['loads']} (of {stats['records']} records); "
                 + (f"{len(diff)} tensors differ from stock {item.format.upper()}'s types: {diff}" if diff
                    else f"every tensor has stock {item.format.upper()}'s type"))
        self.made = {"made_by": f"auto-round {self.version}, {r['dtype']}",
                     "autoround": {"dtype": r["dtype"], "amp": r["amp"], "samples": stats["records"], "loads": r["loads"],
                                   "records": stats, "seconds": round(r["seconds"], 1), "peak_rss_mb": r["peak_rss_mb"],
                                   "types_vs_stock": diff}}
        return f, [f], {item.label: round(r["seconds"], 1)}

    def facts(self, ladder, item) -> dict[str, Any]:
        return self.made


def types_vs_stock(f: Path, fmt: str) -> dict[str, list[str]]:
    """{tensor: [type in `f`, type stock llama-quantize writes for the ftype]} where they differ."""
    from voodoo_quant.gguf.recipe_inputs import gguf_inputs
    from voodoo_quant.gguf.recipes import RecipeTensor, canonical_ftype, recipe

    tensors, params = gguf_inputs(f)
    stock = recipe([RecipeTensor(t.name, t.shape, "F32") for t in tensors], params, canonical_ftype(fmt),
                   has_imatrix=True).types
    return {t.name: [t.type, stock[t.name]] for t in tensors if t.type != stock[t.name]}


# -- the child process: AutoRound itself -----------------------------------------------------------

def quantize(a: argparse.Namespace) -> dict[str, Any]:
    """Run AutoRound's GGUF export; count the samples its own loader kept (it drops records
    silently); write what it did to ``a.result``."""
    import torch

    if a.threads:
        torch.set_num_threads(a.threads)
    from auto_round import AutoRound, calib_dataset

    from voodoo_quant.core import fileio

    loads: list[int] = []  # samples kept by each load (the tuned mode loads the records twice)
    loader = calib_dataset.get_dataloader  # calibration/llm.py imports it at each call: this wrapper counts

    def counted(*args, **kw):
        dl = loader(*args, **kw)
        loads.append(len(dl.dataset))
        return dl

    calib_dataset.get_dataloader = counted
    t = time.monotonic()
    fmt = f"gguf:{a.format}"
    ar = AutoRound(a.model, scheme=fmt, iters=a.iters, dataset=a.dataset, nsamples=a.nsamples, seqlen=a.seq_len,
                   device_map=a.device, amp=a.amp)
    dtype = str(getattr(getattr(ar, "model", None), "dtype", None)).removeprefix("torch.")  # after its own cast
    ar.quantize_and_save(a.out, format=fmt)
    seconds = time.monotonic() - t
    files = sorted(Path(a.out).rglob("*.gguf"))
    if len(files) != 1:
        raise PeerError(f"AutoRound wrote {len(files)} GGUF files under {a.out}, not one: {[str(f) for f in files]}")
    r = {"gguf": str(files[0]), "seconds": seconds, "dtype": dtype, "amp": bool(getattr(ar, "amp", a.amp)),
         "loads": loads, "peak_rss_mb": store.peak_rss_mb()}
    fileio.write_json(Path(a.result), r)
    return r


# -- the command line ----------------------------------------------------------------------------

SHARED = (("model", Path), ("name", str), ("results", Path), ("work", Path), ("degrid_seed", int), ("plays_dir", Path),
          ("python_dir", Path), ("eval_fraction", float), ("split_seed", int), ("calib_chars", int), ("eval_chars", int),
          ("seq_len", int), ("calib_sequences", int), ("ctx", int), ("chunks", int), ("device", str), ("threads", int),
          ("max_minutes", float))


def parse(argv: list[str]) -> tuple[str, Any]:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = ap.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="make and measure the AutoRound files the results file lacks")
    d = quality.BenchConfig.__dataclass_fields__
    for k, typ in SHARED:
        r.add_argument(f"--{k}", type=typ, default=None, help=f"as bench/quality.py run (default {d[k].default})")
    r.add_argument("--calib", nargs="+", default=None, help="calibration domains, as bench/quality.py run")
    r.add_argument("--formats", nargs="+", default=list(DEFAULT_FORMATS), help="AutoRound GGUF formats at iters=0 "
                   f"(default {' '.join(DEFAULT_FORMATS)})")
    r.add_argument("--tuned", default=None, help="one more format in AutoRound's tuned mode (iters > 0)")
    r.add_argument("--iters", type=int, default=200, help="the tuned mode's iterations (default 200)")
    r.add_argument("--amp", action="store_true", help="let AutoRound quantize in bfloat16 (its CPU default); "
                   "default: amp off, the float32 teacher's weights")
    r.add_argument("--keep_files", action="store_true", help="keep each GGUF after measuring it")
    r.add_argument("--no_report", action="store_true", help="do not render the report after the run")
    q = sub.add_parser("quantize", help="(the child process) one AutoRound GGUF export")
    for k, typ in (("model", str), ("format", str), ("iters", int), ("dataset", str), ("seq_len", int),
                   ("nsamples", int), ("device", str), ("out", str), ("result", str)):
        q.add_argument(f"--{k}", type=typ, required=True)
    q.add_argument("--threads", type=int, default=None)
    q.add_argument("--amp", action="store_true")
    a = ap.parse_args(argv)
    if a.command == "quantize":
        return "quantize", a
    kw = {k: getattr(a, k) for k, _ in SHARED if getattr(a, k) is not None}
    if a.calib:
        kw["calib"] = tuple(quality._list(a.calib))
    peer = {"formats": quality._list(a.formats), "tuned": a.tuned, "iters": a.iters, "amp": a.amp}
    return "run", (quality.BenchConfig(keep_files=a.keep_files, **kw), peer, a.no_report)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    what, a = parse(argv)
    if what == "quantize":
        quantize(a)
        return 0
    cfg, peer, no_report = a
    command = shlex.join([".venv/bin/python", os.path.relpath(Path(__file__).resolve(), ROOT), *argv])
    try:
        s = Peer(cfg, command, log=lambda m: print(f"[autoround] {m}", flush=True), **peer).run()
    except PeerError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"[autoround] added {s.added} rows ({s.present} present); "
          + (f"stopped by --max_minutes with {len(s.left)} files left" if s.stopped else "done")
          + (f"; failed: {', '.join(s.failed)}" if s.failed else ""), flush=True)
    if s.added and not no_report:
        print(f"[autoround] report: {quality.render(cfg.results)}")
    return 1 if s.failed else 0


if __name__ == "__main__":
    sys.exit(main())
