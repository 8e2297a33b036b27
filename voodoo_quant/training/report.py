"""Rich rendering of a training run: dry-run menus, live progress, the final per-tensor table."""

from __future__ import annotations

import contextlib
from typing import Iterator

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn
from rich.table import Table

from ..core import qtypes as qt


def _mb(n: float) -> str:
    return f"{n / 1e6:,.2f} MB"


def print_dry_run(console: Console, run) -> None:
    b = run.budget
    t = Table(title="voodoo train --dry_run: menus (cheapest first) and bytes per candidate", show_lines=False)
    t.add_column("tensor")
    t.add_column("GGUF name")
    t.add_column("role")
    t.add_column("row")
    t.add_column("menu: bytes")
    t.add_column("fallbacks / dropped")
    for p in run.plans:
        menu = "  ".join(f"{ty}:{s:,}" for ty, s in zip(p.menu.types, p.sizes))
        notes = ", ".join(f"{a}→{c}" for a, c in p.menu.fallbacks.items())
        if p.menu.dropped_no_imatrix:
            notes += (" " if notes else "") + "dropped (no imatrix): " + ",".join(p.menu.dropped_no_imatrix)
        t.add_row(p.name, p.gguf_name or "?", p.role, str(p.n_per_row), menu, notes)
    console.print(t)
    console.print(
        f"selectable tensors: {len(run.plans)}  weights: {b.n_weights:,}\n"
        f"uniform Q8_0: {_mb(b.q8_bytes)}   achievable: {_mb(b.min_bytes)} ({b.bpw(b.min_bytes):.3f} bpw) – "
        f"{_mb(b.max_bytes)} ({b.bpw(b.max_bytes):.3f} bpw)\n"
        f"target: {_mb(b.target_bytes)} ({b.bpw(b.target_bytes):.3f} bpw, {b.target_bytes / b.q8_bytes:.3f} of Q8_0) "
        f"± {b.tolerance:.1%}; training aims at {_mb(b.train_target_bytes)}"
    )
    for note in getattr(run, "notes", ()):
        console.print(f"note: {note}")
    mem = getattr(run, "memory", None)
    if mem is not None:  # voodoo_quant/memory/plan.py
        for line in mem.lines():
            console.print(line, highlight=False, markup=False)
    time = getattr(run, "time", None)
    if time is not None:  # voodoo_quant/memory/time_plan.py
        for line in time.lines():
            console.print(line, highlight=False, markup=False)


@contextlib.contextmanager
def progress_reporter(console: Console, trainer) -> Iterator:
    total = trainer.cfg.max_steps
    cols = (
        TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(), TextColumn("{task.fields[stats]}"),
        TimeElapsedColumn(), TimeRemainingColumn(),
    )
    with Progress(*cols, console=console, transient=False) as prog:
        task = prog.add_task("train", total=total, stats="building candidates…")

        search: list = []

        def on_step(m) -> None:
            stats = (
                f"loss {m.loss:.4f} CE {m.ce:.3f} KL {m.kl:.4f}" + (f" +gap {m.relaxation_gap:.4f}" if m.relaxation_gap else "")
                + f" pen {m.size_penalty:.2e} "
                f"size {m.expected_bytes / m.target_bytes:.3f}×tgt τ {m.tau:.3f} H {m.gate_entropy:.2f} "
                f"{m.tokens_per_s:,.0f} tok/s"
            )
            prog.update(task, completed=m.step, stats=stats)

        def on_search(ev) -> None:
            if not search:
                search.append(prog.add_task("search", total=ev.max_evals, stats=""))
            prog.update(search[0], completed=ev.evals,
                        stats=f"held-aside KL {ev.kl:.5f}, {ev.accepted} move(s) kept, {_mb(ev.total_bytes)}")

        yield on_step, on_search


def print_result(console: Console, run, result) -> None:
    asg = result.assignment
    t = Table(title="assignment")
    for c in ("tensor", "type", "bpw", "bytes", "confidence", "menu"):
        t.add_column(c)
    for ch in asg.tensors.values():
        t.add_row(
            ch.gguf_name or ch.name, ch.qtype, f"{qt.get(ch.qtype).bpw:.2f}", f"{ch.nbytes:,}",
            f"{ch.confidence:.3f}" if ch.confidence is not None else "-", " ".join(ch.menu),
        )
    console.print(t)
    b = run.budget
    counts = ", ".join(f"{k}×{v}" for k, v in asg.type_counts().items())
    g = asg.meta.get("guarantee")
    if g:
        gt = Table(title="never worse: measured on held-aside calibration sequences (KL teacher ‖ student)")
        for c in ("assignment", "bytes", "KL", "± s.e.", "vs written"):
            gt.add_column(c)
        for c in sorted(g["candidates"], key=lambda c: c["kl"]):
            mark = " (start)" if c["name"] == g["winner"] else ""
            gt.add_row(c["name"] + mark, f"{c['bytes']:,}", f"{c['kl']:.6f}", f"{c['kl_stderr']:.6f}",
                       f"{c['kl'] / g['final_kl']:.3f}×" if g["final_kl"] > 0 else "-")
        console.print(gt)
        s = g.get("search")
        if s:
            console.print(f"search: {s['evals']} evaluation(s), {s['probes']} probe(s), {len(s['moves'])} move(s) kept: "
                          f"KL {s['start_kl']:.6f} → {s['final_kl']:.6f} (± {s['final_kl_stderr']:.6f})")
            for mv in s["moves"]:
                ch = ", ".join(f"{n} {a}→{b}" for n, a, b in mv["changes"])
                console.print(f"  {ch}: {mv['bytes']:+,} bytes, KL {mv['kl_before']:.6f} → {mv['kl_after']:.6f}")
            c = s.get("confirm")
            if c:
                console.print(f"confirmed on {c['sequences']} sequences the search never saw: KL {c['start_kl']:.6f} → "
                              f"{c['final_kl']:.6f} (drop {c['drop']:+.6f} ± {c['drop_stderr']:.6f}): "
                              + ("the search's result is written" if c["kept"] else "not better there, so its start is written"))
    console.print(
        f"baked: {_mb(asg.total_bytes)} ({asg.bpw:.3f} bpw) vs target {_mb(b.target_bytes)} "
        f"(±{b.tolerance:.1%}); upgrades moved {result.bake.upgraded}, repair moves down {result.bake.repaired} / up {result.bake.filled}\n"
        f"types: {counts}\n"
        f"wrote {result.output_pt}, {result.assignment_json}, {result.tensor_types}"
    )
