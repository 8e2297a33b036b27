"""Decide settings on dev text, never on the eval plays: KLD of GGUFs on training sequences no stage used.

The quality bench's eval text (held-out plays) is for reporting; choosing a setting by it is tuning
on held-out text. This script measures files of a bench directory (``bench/quality.py --out``) on
*dev* text instead: training sequences from the middle of ``train_tokens.pt``, away from the ones the
stages read (the imatrix's calibration text and the Fisher pass take the first sequences, the
guarantee and the search hold aside the last ones), scored by stock ``llama-perplexity
--kl-divergence`` against the F32 teacher. Beside each file's mean KLD ± its standard error over
chunks it prints the difference to the first file *paired by chunk* (same text, so the
chunk-to-chunk spread of the text cancels) with that difference's standard error.

    .venv/bin/python bench/dev_check.py --out runs/q2 --chunks 32 FILE.gguf [FILE.gguf ...]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import math
import statistics
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import quality_report as report  # noqa: E402
from quality import MODEL_NAME, QualityBench, parse  # noqa: E402


class DevCheck(QualityBench):
    def __init__(self, out: Path, chunks: int, offset: int | None):
        cfg = parse(["--out", str(out), "--eval_chunks", str(chunks)])
        super().__init__(cfg, "dev_check")
        self.offset = offset

    def make_dev_text(self) -> Path:
        from voodoo_quant import fileio
        from voodoo_quant.modeling import load_tokenizer
        from voodoo_quant.tools.data import load_tokens

        tokens = load_tokens(self.data / "train_tokens.pt", what="train tokens")
        n = math.ceil(1.1 * self.cfg.eval_chunks * self.cfg.ctx / tokens.shape[1])
        lo = tokens.shape[0] // 2 if self.offset is None else self.offset
        if lo < 64 or lo + n > tokens.shape[0] - 64:
            raise SystemExit(f"dev sequences {lo}..{lo + n} overlap the first or last 64 train sequences "
                             "(calibration, Fisher, held aside); give another --offset or fewer --chunks")
        path = self.cfg.out / "dev" / f"dev-{lo}-{n}.txt"
        if not path.is_file():
            tok = load_tokenizer(self.hf)
            fileio.write_text(path, tok.decode(tokens[lo: lo + n].reshape(-1).tolist(), skip_special_tokens=True))
        return path

    def dev_base(self, text: Path) -> tuple[Path, dict]:
        from voodoo_quant import fileio

        self.eval_text = text
        tag = hashlib.sha256(json.dumps([text.name, self.cfg.ctx, self.cfg.eval_chunks]).encode()).hexdigest()[:12]
        base = self.cfg.out / "dev" / f"base-{tag}.kld"
        if not base.is_file():
            fileio.write_with(base, lambda tmp: self._run(
                [self._tool("llama-perplexity"), "-m", self.ref, "-f", text, "--kl-divergence-base", tmp,
                 *self._ppl_args()], "dev-base"))
        return base, {"tag": f"dev-{tag}"}


def paired(a: list[float], b: list[float]) -> tuple[float, float | None]:
    d = [y - x for x, y in zip(a, b)]
    return statistics.fmean(d), (statistics.stdev(d) / math.sqrt(len(d)) if len(d) >= 2 else None)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, required=True, help="a bench/quality.py output directory")
    ap.add_argument("--chunks", type=int, default=32)
    ap.add_argument("--offset", type=int, default=None, help="first dev train sequence (default: the middle)")
    ap.add_argument("files", type=Path, nargs="+")
    a = ap.parse_args()
    dev = DevCheck(a.out, a.chunks, a.offset)
    base, info = dev.dev_base(dev.make_dev_text())
    rows = [dev.eval_file(f, base, info) for f in a.files]
    first = rows[0]
    print(f"dev text: {a.chunks} chunks of {dev.cfg.ctx} tokens of train sequences no stage read ({MODEL_NAME})")
    print(f"{'file':60s} {'MB':>7s} {'KLD':>9s} {'±':>8s} {'Δ vs first':>11s} {'± paired':>9s}")
    for r in rows:
        d, se = paired(first["kld_chunks"], r["kld_chunks"])
        print(f"{r['name']:60s} {r['size_bytes'] / 1e6:7.2f} {r['kld_mean']:9.5f} {r['kld_stderr']:8.5f} "
              f"{d:+11.5f} {se if se is not None else float('nan'):9.5f}")


if __name__ == "__main__":
    main()
