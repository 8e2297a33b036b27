"""The summary table `voodoo quantize` prints at its end."""

from __future__ import annotations

from rich.console import Console
from rich.table import Table


def print_summary(console: Console, cfg, result) -> None:
    from ..tools.card import nearest_stock  # lazy: keeps `voodoo --help` light

    t = Table(title=f"voodoo quantize: {cfg.model_name} ladder ({len(result.ran)} steps ran, "
                    f"{len(result.skipped)} skipped: same inputs)")
    for col in ("file", "MB", "bpw", "PPL", "KLD mean", "± s.e.", "KLD p99", "nearest stock (KLD mean)"):
        t.add_column(col, justify="left" if col in ("file", "nearest stock (KLD mean)") else "right")
    if result.eval is None:
        for s, p in result.files.items():
            t.add_row(p.name, f"{p.stat().st_size / 1e6:.2f}", "", "", "", "", "", "")
    else:
        rows = result.eval["rows"]
        stock = [r for r in rows if r["method"] == "stock"]
        for r in sorted(rows, key=lambda r: r["size_bytes"]):
            near = ""
            if r["method"] == "voodoo":
                near = ", ".join(f"{s['name']} {s['kld_mean']:.4f}" for s in nearest_stock(r, stock) if s is not None)
            style = "bold" if r["method"] == "voodoo" else "dim"
            t.add_row(r["name"], f"{r['size_bytes'] / 1e6:.2f}", f"{r['bpw']:.3f}", f"{r['ppl']:.3f}",
                      f"{r['kld_mean']:.4f}", "—" if r.get("kld_stderr") is None else f"{r['kld_stderr']:.4f}",
                      f"{r['kld_p99']:.4f}", near, style=style)
    console.print(t)
    console.print(f"card: {result.card}")
