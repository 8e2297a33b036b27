"""Quality benchmark: Voodoo vs stock llama.cpp recipes on the real model, held-out text.

Everything is built from scratch into ``--out`` with the stock tools and the ``voodoo`` CLI, and
every step skips itself when its output exists (rerun the same command to resume):

1. ``voodoo data``: the plays, split by document (eval plays are never calibration text);
2. ``voodoo make-teacher --degrid_seed 0 --dtype float32 --hf_out``: the de-gridded float teacher
   (docs/facts.md: the raw model lies on a Q4_1 grid that flatters Q4_1/Q5_1/K rungs);
3. ``convert_hf_to_gguf.py --outtype f32``: the teacher as a GGUF, the KL reference and the
   source of every stock recipe;
4. stock ``llama-imatrix`` on calibration text = the first train sequences, detokenized;
5. stock ``llama-quantize --imatrix`` per recipe (uniform Q8_0 always: it is the KLD floor);
6. ``voodoo train`` (gates, and ``--method sensitivity``: the one-shot knapsack) + ``voodoo export``
   per standard size, same imatrix and calibration text;
7. stock ``llama-perplexity --kl-divergence`` of every file against the F32 teacher on held-out
   plays (base log-probs computed once; each file's result cached by its size and mtime).

Writes ``results.md`` (with the command to reproduce), ``results.json`` and ``pareto.png``. The
targets (excess KLD ratios, ``quality_report.targets``) are computed and reported, not asserted.

    .venv/bin/python bench/quality.py --out runs/bench-quality            # full (about an hour)
    .venv/bin/python bench/quality.py --out /tmp/bq --quick               # smoke run
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import os
import shlex
import subprocess
import sys
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import quality_report as report  # noqa: E402

from voodoo_quant import envs, fileio, paths  # noqa: E402
from voodoo_quant import qtypes as qt  # noqa: E402

MODEL_NAME = "SmolLM2-135M-Instruct"
FLOOR = "Q8_0"
STOCK = ("Q4_0", "IQ4_NL", "IQ4_XS", "Q4_K_S", "Q4_K_M", "Q5_0", "Q5_K_S", "Q5_K_M", "Q6_K", "Q3_K_M",
         "Q3_K_L", "Q2_K", "IQ3_M", "IQ2_M")
QUICK_STOCK = ("Q4_0", "IQ4_XS", "Q4_K_M")
# SmolLM2's 576-wide rows take 32-block types only; ffn_down (1536 wide) keeps the K/IQ rungs.
MENU = ("Q8_0", "Q6_K", "Q5_K", "Q5_0", "Q4_K", "IQ4_XS", "IQ4_NL", "Q3_K", "IQ3_S", "IQ2_S")
# voodoo: the defaults (gates + guarantee + search); sensitivity: the one-shot knapsack on the Fisher
# table (the default kind); sensitivity_output: the knapsack on the output-error table.
METHODS = ("voodoo", "sensitivity", "sensitivity_output", "voodoo_gptq", "sensitivity_gptq")
# *_gptq: the same with `--error_compensation gptq` (voodoo_quant/compensate.py); the others pass
# `none`, so that they stay the plain candidates now that train's default (auto) compensates.
GPTQ_ARGS = ("--error_compensation", "gptq")
PLAIN_ARGS = ("--error_compensation", "none")
# Uniform files (`llama-quantize --pure`): every tensor one type (fallback for 576-wide rows).
PURE = ("Q4_0", "IQ4_NL", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


@dataclass
class QualityConfig:
    out: Path
    sizes: tuple[int, ...] = (55, 60, 65, 70, 75)
    steps: int = 30
    seq_len: int = 256
    eval_chunks: int = 20
    calib_chunks: int = 32
    ctx: int = 512
    stock: tuple[str, ...] = STOCK
    methods: tuple[str, ...] = METHODS
    menu: tuple[str, ...] = MENU
    degrid_seed: int = 0
    threads: int | None = None
    seeds: tuple[int, ...] = (0,)  # training seeds of the voodoo runs ...
    seed_sizes: tuple[int, ...] = ()  # ... at these sizes (every other size: the first seed only)
    pure: tuple[str, ...] = PURE
    train_args: tuple[str, ...] = ()  # extra `voodoo train` flags of the voodoo runs (ablations)
    method_sizes: tuple[tuple[str, tuple[int, ...]], ...] = ()  # (method, sizes): run it at these sizes only

    def __post_init__(self) -> None:
        self.out = Path(self.out)
        if not self.sizes:
            raise SystemExit("--sizes: give at least one size")
        bad = [s for s in self.sizes if not 10 <= s <= 100]
        if bad:
            raise SystemExit(f"--sizes: percent of the Q8_0 size, 10..100 (got {bad})")
        if not self.seeds:
            raise SystemExit("--seeds: give at least one seed")
        bad = [m for m in self.methods if m not in METHODS]
        if bad or not self.methods:
            raise SystemExit(f"--methods: choose from {', '.join(METHODS)} (got {', '.join(self.methods) or 'none'})")
        bad = [s for s in self.stock if s not in qt.LLAMA_FTYPES]
        if bad:
            raise SystemExit(f"--stock: unknown llama-quantize recipe(s) {', '.join(bad)}; known: {', '.join(qt.LLAMA_FTYPES)}")
        for m, ss in self.method_sizes:
            if m not in self.methods or not set(ss) <= set(self.sizes):
                raise SystemExit(f"--sizes_for {m}=...: the method must be in --methods and its sizes in --sizes")
        self.stock = tuple(dict.fromkeys([FLOOR, *self.stock]))  # the floor is always measured, first
        self.menu = tuple(qt.get(t).name for t in self.menu)
        for flag, v in (("--steps", self.steps), ("--seq_len", self.seq_len), ("--eval_chunks", self.eval_chunks),
                        ("--calib_chunks", self.calib_chunks)):
            if v < 1:
                raise SystemExit(f"{flag} must be >= 1, got {v}")
        if self.ctx < 8 or self.ctx % 2:
            raise SystemExit(f"--ctx must be an even number >= 8, got {self.ctx}")

    def artifact_settings(self) -> dict[str, Any]:
        """What the files under --out depend on (eval settings are keyed per result instead)."""
        return {"seq_len": self.seq_len, "calib_chunks": self.calib_chunks, "ctx": self.ctx, "steps": self.steps,
                "menu": list(self.menu), "degrid_seed": self.degrid_seed, "train_args": list(self.train_args)}

    def seeds_for(self, method: str, size: int) -> tuple[int, ...]:
        only = dict(self.method_sizes).get(method)
        if only is not None and size not in only:
            return ()
        if not method.startswith("voodoo"):
            return (0,)  # the knapsacks train nothing: no seed
        return self.seeds if size in self.seed_sizes else self.seeds[:1]


def _file_key(p: Path) -> list[int]:
    st = p.stat()
    return [st.st_size, st.st_mtime_ns]


def _sha256(p: Path) -> str:
    return hashlib.sha256(p.read_bytes()).hexdigest()


class QualityBench:
    def __init__(self, cfg: QualityConfig, command: str):
        self.cfg = cfg
        self.command = command
        o = cfg.out
        self.gguf_src = _embedded("smollm2_gguf_path")
        self.data, self.hf, self.gguf = o / "data", o / "hf", o / "gguf"
        self.ref = self.gguf / f"{MODEL_NAME}.F32.gguf"
        self.imatrix = o / "imatrix.gguf"
        self.calib_text, self.eval_text = o / "calib.txt", o / "eval_text.txt"
        self.threads = cfg.threads or envs.quant_workers()
        self.voodoo = Path(sys.executable).with_name("voodoo")
        if not self.voodoo.is_file():
            raise SystemExit(f"the voodoo CLI is not beside {sys.executable}; run `make bootstrap`")
        self.timings_path = o / "timings.json"
        self.timings: dict[str, float] = json.loads(self.timings_path.read_text()) if self.timings_path.is_file() else {}

    # -- running things ----------------------------------------------------------------------
    def _run(self, argv: list[Any], step: str) -> str:
        """Run one step with its output in logs/<step>.log; a failure stops the bench with the log's tail."""
        log = self.cfg.out / "logs" / f"{step}.log"
        log.parent.mkdir(parents=True, exist_ok=True)
        argv = [str(a) for a in argv]
        print(f"[bench] {step}: {shlex.join(argv)}", flush=True)
        env = dict(os.environ, GGML_NO_BACKTRACE="1")
        t0 = time.perf_counter()
        with open(log, "w", encoding="utf-8", errors="replace") as fh:
            fh.write(shlex.join(argv) + "\n")
            fh.flush()
            rc = subprocess.run(argv, stdout=fh, stderr=subprocess.STDOUT, env=env, cwd=ROOT).returncode
        dt = time.perf_counter() - t0
        text = log.read_text(encoding="utf-8", errors="replace")
        if rc != 0:
            tail = "\n".join(text.splitlines()[-15:])
            raise SystemExit(f"[bench] {step} failed (exit {rc}); end of {log}:\n{tail}")
        self.timings[step] = round(dt, 1)
        fileio.write_json(self.timings_path, self.timings)
        print(f"[bench] {step}: {dt:.0f} s", flush=True)
        return text

    def _tool(self, name: str) -> Path:
        return paths.tool_path(name)

    # -- pipeline ----------------------------------------------------------------------------
    def check_settings(self) -> None:
        p = self.cfg.out / "settings.json"
        want = self.cfg.artifact_settings()
        if p.is_file():
            have = json.loads(p.read_text())
            if have != want:
                diff = ", ".join(f"{k}: {have.get(k)} → {v}" for k, v in want.items() if have.get(k) != v)
                raise SystemExit(f"{self.cfg.out} was made with other settings ({diff}); use another --out")
        else:
            fileio.write_json(p, want)

    def make_data(self) -> None:
        if not (self.data / "eval_tokens.pt").is_file():
            self._run([self.voodoo, "data", "--model", self.gguf_src, "--output_dir", self.data, "--seq_len",
                       self.cfg.seq_len, "--glob", "*.md", "--eval_fraction", "0.15", _embedded("shakespeare_dir")], "data")
        meta = json.loads((self.data / "meta.json").read_text())
        if meta["seq_len"] < self.cfg.seq_len:
            raise SystemExit(f"{self.data} holds sequences of {meta['seq_len']} tokens < --seq_len {self.cfg.seq_len}")
        held_out = set(meta["split"]["eval_documents"])
        train_docs = {s["path"] for s in meta["sources"]} - held_out
        self.split = {"eval_documents": sorted(Path(d).stem for d in held_out), "train_documents": len(train_docs),
                      "eval_tokens": meta["eval"]["tokens"], "train_tokens": meta["train"]["tokens"]}

    def make_teacher(self) -> None:
        if not (self.hf / "config.json").is_file():
            self._run([self.voodoo, "make-teacher", "--model", self.gguf_src, "--output_dir", self.cfg.out / "teacher",
                       "--dtype", "float32", "--degrid_seed", self.cfg.degrid_seed, "--hf_out", self.hf], "make-teacher")
        if not self.ref.is_file():
            self.gguf.mkdir(parents=True, exist_ok=True)
            fileio.write_with(self.ref, lambda tmp: self._run(
                [sys.executable, paths.convert_script(), self.hf, "--outtype", "f32", "--outfile", tmp], "convert-f32"))

    def make_texts(self) -> None:
        """Calibration text (the first train sequences) and held-out eval text, detokenized."""
        from voodoo_quant.modeling import load_tokenizer
        from voodoo_quant.tools.data import load_tokens
        from voodoo_quant.tools.evaluate import detokenize

        if not self.calib_text.is_file():
            tokens = load_tokens(self.data / "train_tokens.pt", what="train tokens")
            # 10 % spare: llama-imatrix re-tokenizes the text and may get slightly fewer tokens
            n = math.ceil(1.1 * self.cfg.calib_chunks * self.cfg.ctx / tokens.shape[1])
            if n > tokens.shape[0]:
                raise SystemExit(f"--calib_chunks {self.cfg.calib_chunks} needs {n} train sequences, there are {tokens.shape[0]}")
            tok = load_tokenizer(self.hf)
            fileio.write_text(self.calib_text, tok.decode(tokens[:n].reshape(-1).tolist(), skip_special_tokens=True))
        if not self.eval_text.is_file():
            detokenize(self.data / "eval_tokens.pt", self.hf, self.eval_text)

    def make_imatrix(self) -> None:
        if not self.imatrix.is_file():
            fileio.write_with(self.imatrix, lambda tmp: self._run(
                [self._tool("llama-imatrix"), "-m", self.ref, "-f", self.calib_text, "-o", tmp, "-c", self.cfg.ctx,
                 "--chunks", self.cfg.calib_chunks, "--no-ppl", "-t", self.threads], "imatrix"))

    def stock_file(self, recipe: str) -> Path:
        return self.gguf / f"{MODEL_NAME}.stock-{recipe}.gguf"

    def pure_file(self, q: str) -> Path:
        return self.gguf / f"{MODEL_NAME}.pure-{q}.gguf"

    def make_stock(self) -> None:
        for q in self.cfg.stock:
            f = self.stock_file(q)
            if not f.is_file():
                fileio.write_with(f, lambda tmp, q=q: self._run(
                    [self._tool("llama-quantize"), "--imatrix", self.imatrix, self.ref, tmp, q, self.threads], f"quantize-{q}"))
        for q in self.cfg.pure:
            f = self.pure_file(q)
            if not f.is_file():
                fileio.write_with(f, lambda tmp, q=q: self._run(
                    [self._tool("llama-quantize"), "--pure", "--imatrix", self.imatrix, self.ref, tmp, q, self.threads],
                    f"quantize-pure-{q}"))

    def run_dir(self, method: str, size: int, seed: int = 0) -> Path:
        return self.cfg.out / "runs" / f"{method}{size}" / f"seed{seed}"

    def method_file(self, method: str, size: int, seed: int = 0) -> Path:
        tag = {"voodoo": f"Voodoo{size}.seed{seed}", "sensitivity": f"Sensitivity{size}",
               "sensitivity_output": f"SensitivityOutput{size}", "voodoo_gptq": f"Voodoo{size}.gptq.seed{seed}",
               "sensitivity_gptq": f"Sensitivity{size}.gptq"}[method]
        return self.gguf / f"{MODEL_NAME}.{tag}.gguf"

    def make_method(self, method: str, size: int, seed: int = 0) -> Path:
        run = self.run_dir(method, size, seed)
        step = f"{method}{size}-seed{seed}"
        if not (run / "assignment.json").is_file():
            argv = [self.voodoo, "train", "--model", self.hf, "--data_dir", self.data, "--imatrix", self.imatrix,
                    "--compression_ratio", f"{size / 100:.2f}", "--seq_len", self.cfg.seq_len,
                    "--max_steps", self.cfg.steps, "--candidate_types", ",".join(self.cfg.menu), "--seed", seed,
                    "--output_dir", run, "--output_name", f"{MODEL_NAME}-{method}{size}.pt"]
            if method.startswith("voodoo"):
                argv += list(self.cfg.train_args)
            else:
                argv += ["--method", "sensitivity"]
                if method == "sensitivity_output":
                    argv += ["--sensitivity_kind", "output"]
            argv += list(GPTQ_ARGS if method.endswith("_gptq") else PLAIN_ARGS)
            self._share_sensitivity_table(run, method, seed)
            self._run(argv, f"train-{step}")
        f = self.method_file(method, size, seed)
        if not f.is_file():
            argv = [self.voodoo, "export", "--model", self.hf, "--assignment", run / "assignment.json", "--imatrix",
                    self.imatrix, "--output_dir", self.gguf, "--model_name", MODEL_NAME, "--output_name", f.name]
            self._run(argv, f"export-{step}")
            if not f.is_file():
                raise SystemExit(f"[bench] export-{step} wrote no {f}")
        return f

    def _share_sensitivity_table(self, run: Path, method: str, seed: int) -> None:
        """The table depends on the model, menus, kind, calibration tokens and seed (the Fisher
        draw), not on the size: reuse the newest one computed for another size of the same kind
        and seed (train checks its key and recomputes on a mismatch)."""
        from voodoo_quant.training.sensitivity import TABLE_NAME

        if (run / TABLE_NAME).is_file():
            return
        def kind_of(m: str) -> str:  # compensated candidates give another table
            return ("output" if m == "sensitivity_output" else "fisher") + ("-gptq" if m.endswith("_gptq") else "")

        kind = kind_of(method)
        same = [m for m in METHODS if kind_of(m) == kind]
        tables = [t for m in same for t in (self.cfg.out / "runs").glob(f"{m}*/seed{seed}/{TABLE_NAME}")]
        if tables:
            run.mkdir(parents=True, exist_ok=True)
            fileio.write_bytes(run / TABLE_NAME, max(tables, key=lambda t: t.stat().st_mtime_ns).read_bytes())

    # -- evaluation --------------------------------------------------------------------------
    def _ppl_args(self) -> list[Any]:
        return ["-c", self.cfg.ctx, "--chunks", self.cfg.eval_chunks, "-t", self.threads]

    def eval_base(self) -> tuple[Path, dict[str, Any]]:
        """The F32 teacher's log-probs on the eval text (computed once per text/ctx/chunks)."""
        from voodoo_quant.tools.evaluate import parse_final_ppl

        ev = self.cfg.out / "eval"
        key = {"reference": _file_key(self.ref), "text": _sha256(self.eval_text), "ctx": self.cfg.ctx,
               "chunks": self.cfg.eval_chunks}
        tag = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:12]
        base, info_path = ev / f"base-{tag}.kld", ev / f"base-{tag}.json"
        if base.is_file() and info_path.is_file():
            return base, json.loads(info_path.read_text())
        ev.mkdir(parents=True, exist_ok=True)
        out: dict[str, str] = {}
        fileio.write_with(base, lambda tmp: out.update(text=self._run(
            [self._tool("llama-perplexity"), "-m", self.ref, "-f", self.eval_text, "--kl-divergence-base", tmp,
             *self._ppl_args()], "eval-base")))
        info = {"key": key, "tag": tag, "reference_ppl": parse_final_ppl(out["text"])}
        # The original (gridded Q4_1) model on the same text: the teacher's de-gridding cost, for the record.
        text = self._run([self._tool("llama-perplexity"), "-m", self.gguf_src, "-f", self.eval_text, *self._ppl_args()],
                         "eval-original")
        info["original_ppl"] = parse_final_ppl(text)
        fileio.write_json(info_path, info)
        return base, info

    def eval_file(self, f: Path, base: Path, base_info: dict[str, Any]) -> dict[str, Any]:
        from voodoo_quant.tools.evaluate import chunk_klds, parse_kld_report
        from voodoo_quant.tools.llama_tools import gguf_tensor_stats

        cache = self.cfg.out / "eval" / f"rows-{base_info['tag']}" / f"{f.name}.json"
        key = _file_key(f)
        if cache.is_file():
            row = json.loads(cache.read_text())
            if row.get("file_key") == key:
                return row
        text = self._run([self._tool("llama-perplexity"), "-m", f, "--kl-divergence-base", base, "--kl-divergence",
                          *self._ppl_args()], f"eval-{f.stem}")
        data_bytes, n_weights = gguf_tensor_stats(f)
        row = {"name": f.name, "file": str(f), "size_bytes": f.stat().st_size, "bpw": 8.0 * data_bytes / n_weights,
               **parse_kld_report(text), "kld_chunks": chunk_klds(text), "file_key": key}  # with kld_stderr
        fileio.write_json(cache, row)
        return row

    # -- everything --------------------------------------------------------------------------
    def run(self) -> dict[str, Any]:
        cfg = self.cfg
        cfg.out.mkdir(parents=True, exist_ok=True)
        self.check_settings()
        self.make_data()
        self.make_teacher()
        self.make_texts()
        self.make_imatrix()
        self.make_stock()
        base, base_info = self.eval_base()
        rows: list[dict[str, Any]] = []

        def add(f: Path, method: str, size: int | None, seed: int | None) -> None:
            row = self.eval_file(f, base, base_info)
            extra = {}
            if method in METHODS:
                meta = json.loads((self.run_dir(method, size, seed or 0) / "assignment.json").read_text())["meta"]
                extra = {"guarantee": meta.get("guarantee"), "train_s": self.timings.get(f"train-{method}{size}-seed{seed or 0}")}
            rows.append({**row, "method": method, "size_percent": size, "seed": seed, **extra})
            self.write(rows, base_info)  # after every file: a stopped bench still reports what it measured

        # The floor; the first size (every method); the stock and uniform files; the other sizes;
        # then the other seeds: a bench stopped early still reports comparable rows.
        add(self.stock_file(FLOOR), "stock", None, None)
        todo = [(s, m, cfg.seeds_for(m, s)[:1]) for s in cfg.sizes for m in cfg.methods]
        todo += [(s, m, cfg.seeds_for(m, s)[1:]) for s in cfg.sizes for m in cfg.methods]
        refs = [(self.stock_file(q), "stock") for q in cfg.stock if q != FLOOR] + [(self.pure_file(q), "uniform") for q in cfg.pure]
        n_first = len(cfg.methods)
        for i, (size, method, seeds) in enumerate(todo):
            for seed in seeds:
                add(self.make_method(method, size, seed), method, size, seed)
            if i == n_first - 1:
                for f, kind in refs:
                    add(f, kind, None, None)
        return self.write(rows, base_info)

    def write(self, rows: list[dict[str, Any]], base_info: dict[str, Any]) -> dict[str, Any]:
        cfg = self.cfg
        result = {
            "command": self.command,
            "setup": {"model": MODEL_NAME, **asdict(cfg) | {"out": str(cfg.out)}, "menu": list(cfg.menu),
                      "reference": str(self.ref), "reference_ppl": base_info["reference_ppl"],
                      "original_ppl": base_info["original_ppl"], "split": self.split, "threads": self.threads},
            "rows": rows,
            "targets": report.targets(rows, self.stock_file(FLOOR).name),
            "timings_s": self.timings,
        }
        fileio.write_json(cfg.out / "results.json", result)
        fileio.write_text(cfg.out / "results.md", report.markdown(result))
        report.plot(result, cfg.out / "pareto.png")
        return result


def _embedded(fn: str) -> Path:
    from voodoo_quant.tools import embedded

    return Path(getattr(embedded, fn)())


def _csv(v: str) -> list[str]:
    return [p for p in v.replace(",", " ").split() if p]


def parse(argv: list[str]) -> QualityConfig:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=ROOT / "runs" / "bench-quality", help="everything goes here")
    ap.add_argument("--sizes", default=None, help="sizes in percent of Q8_0, comma separated (default 55,60,65,70,75)")
    ap.add_argument("--steps", type=int, default=None, help="training steps per size (default 30)")
    ap.add_argument("--seq_len", type=int, default=None, help="training tokens per sequence (default 256)")
    ap.add_argument("--eval_chunks", type=int, default=None, help="llama-perplexity chunks of -c tokens (default 20)")
    ap.add_argument("--calib_chunks", type=int, default=None, help="llama-imatrix chunks of -c tokens (default 32)")
    ap.add_argument("--ctx", type=int, default=512, help="-c of llama-imatrix and llama-perplexity")
    ap.add_argument("--stock", default=None, help="llama-quantize recipes (Q8_0, the floor, is always added)")
    ap.add_argument("--methods", default=None, help="voodoo,sensitivity (default both)")
    ap.add_argument("--menu", default=None, help="voodoo --candidate_types (default: " + " ".join(MENU) + ")")
    ap.add_argument("--threads", type=int, default=None, help="threads of the stock tools (default VOODOO_QUANT_WORKERS)")
    ap.add_argument("--seeds", default=None, help="training seeds of the voodoo runs (default 0)")
    ap.add_argument("--seed_sizes", default=None, help="sizes at which every seed runs (default: none)")
    ap.add_argument("--pure", default=None, help="uniform llama-quantize --pure files (default " + ",".join(PURE) + ")")
    ap.add_argument("--sizes_for", action="append", default=[], metavar="METHOD=S1,S2",
                    help="run METHOD at these sizes only (repeatable), e.g. sensitivity_output=60,80")
    ap.add_argument("--train_args", default=None, help="extra voodoo train flags of the voodoo runs, one string")
    ap.add_argument("--quick", action="store_true",
                    help="smoke run: sizes 60,70, stock Q4_0 IQ4_XS Q4_K_M, 5 steps, 4 eval chunks, 8 calibration chunks")
    a = ap.parse_args(argv)
    quick = dict(sizes=(60, 70), stock=QUICK_STOCK, steps=5, eval_chunks=4, calib_chunks=8) if a.quick else {}
    given = {
        "sizes": None if a.sizes is None else tuple(int(s) for s in _csv(a.sizes)),
        "stock": None if a.stock is None else tuple(_csv(a.stock)),
        "methods": None if a.methods is None else tuple(_csv(a.methods)),
        "menu": None if a.menu is None else tuple(_csv(a.menu)),
        "steps": a.steps, "seq_len": a.seq_len, "eval_chunks": a.eval_chunks, "calib_chunks": a.calib_chunks,
        "seeds": None if a.seeds is None else tuple(int(s) for s in _csv(a.seeds)),
        "seed_sizes": None if a.seed_sizes is None else tuple(int(s) for s in _csv(a.seed_sizes)),
        "pure": None if a.pure is None else tuple(_csv(a.pure)),
        "train_args": None if a.train_args is None else tuple(shlex.split(a.train_args)),
        "method_sizes": tuple((m, tuple(int(x) for x in _csv(v))) for m, _, v in (f.partition("=") for f in a.sizes_for)) or None,
    }
    kw = {**quick, **{k: v for k, v in given.items() if v is not None}}
    return QualityConfig(out=a.out, ctx=a.ctx, threads=a.threads, **kw)


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    cfg = parse(argv)
    script = os.path.relpath(Path(__file__).resolve(), ROOT)
    command = shlex.join([".venv/bin/python", script, *argv])
    t0 = time.perf_counter()
    result = QualityBench(cfg, command).run()
    print(report.markdown(result))
    print(f"[bench] {cfg.out / 'results.md'}, results.json, pareto.png ({time.perf_counter() - t0:.0f} s)")


if __name__ == "__main__":
    main()
