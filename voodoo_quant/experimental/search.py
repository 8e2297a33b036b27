"""The final search: local moves on the baked assignment, kept only when the measured KL drops.

The gates' argmax is a good start, not an optimum: the soft mixture they trained on is not the
one-hot file, saturated gates stop hearing the size penalty, and the bake has to settle what the
gates left undecided. This stage works on the file itself. From the start assignment it tries

- single moves: one tensor one rung up (when the bytes fit under the budget's upper bound) or
  one rung down (when that is predicted to *lower* the KL), and
- pairs: one tensor one rung up and another one rung down, the total staying inside the budget,

each *measured* (``objective.HeldAside``: KL(teacher ‖ baked student) on calibration sequences
held aside from the training batches, never the eval text) and accepted only when the KL drops
(with ``--search_margin z``: by more than z standard errors of the per-sequence drops, so that a
move which helps some sequences and hurts others is not taken for a gain of the file).
Which moves to try first comes from the gates' own gradient: one probe (forward + backward at the
one-hot mixture of the current assignment) predicts every move's ΔKL to first order,
``g_tj − g_tk`` (``objective.HeldAside.probe``); moves are tried most-promising first and the
probe is redone after a few acceptances or when the predicted list is used up.

The search keeps what beat the held-aside KL, so its own gain is biased: among dozens of moves
measured on a few sequences, some win by chance (SmolLM2-135M at Voodoo70: −6 % on the 8
held-aside sequences, −0.8 ± 1.1 % on 64 others; ``bench/search_transfer.py``). ``confirm``
therefore measures the start and the result once more on sequences the search never saw
(``--search_confirm``) and keeps the result only when it is better there too: an unbiased
estimate of what the search bought, and a file never worse than its start on fresh text by
more than that split's noise.

``--search_evals`` bounds the measurements. The state (current assignment, measured KL, moves
tried and accepted, evaluations spent) is journaled to ``search.json`` after every measurement,
so a killed run resumes where it stopped. Tensors pinned by ``--tensor_upgrades`` never move.
Under tensor parallelism every rank runs the same search on the same measurements
(``objective.TPHeldAside``), so every rank takes the same moves.
"""

from __future__ import annotations

import hashlib
import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Mapping, Sequence

import numpy as np

from ..core import fileio
from ..training.objective import HeldAside, Measurement, layer_of
from ..training.rungs import Rungs, serve, total_bytes, types_of

log = logging.getLogger(__name__)

JOURNAL_NAME = "search.json"
JOURNAL_VERSION = 1
PAIR_UPS = 48  # most promising up-moves paired ...
PAIR_DOWNS = 192  # ... with the cheapest down-moves


@dataclass(frozen=True)
class Move:
    changes: tuple[tuple[str, int, int], ...]  # (tensor, from rung, to rung)
    predicted: float  # first-order ΔKL from the probe
    dbytes: int

    @property
    def key(self) -> str:
        return ";".join(f"{n}:{a}>{b}" for n, a, b in self.changes)


@dataclass
class SearchEvent:
    """One measurement, for progress displays."""

    evals: int
    max_evals: int
    kl: float
    accepted: int
    total_bytes: int


@dataclass
class SearchResult:
    current: dict[str, int]
    start: Measurement
    final: Measurement
    evals: int
    probes: int
    total_bytes: int
    accepted: list[dict] = field(default_factory=list)  # what each accepted move did
    resumed: bool = False

    def summary(self) -> dict:
        return {"start_kl": self.start.kl, "final_kl": self.final.kl, "final_kl_stderr": self.final.stderr,
                "evals": self.evals, "probes": self.probes, "moves": self.accepted, "resumed": self.resumed}


def _quadratic(curv: Mapping[str, dict] | None, name: str, a: str, b: str) -> float:
    """½ Σ F (W_b − W_a)² from the curvature matrices (0 where they do not cover the types)."""
    c = (curv or {}).get(name)
    if c is None or a not in c["types"] or b not in c["types"]:
        return 0.0
    i, j = c["types"].index(a), c["types"].index(b)
    m = c["m"]
    return max(0.0, m[i][i] + m[j][j] - 2.0 * m[i][j])


def predicted(rungs: Mapping[str, Rungs], grads: Mapping[str, Sequence[float]], curv: Mapping[str, dict] | None,
              name: str, a: int, b: int) -> float:
    """Second-order ΔKL of moving `name` from rung a to b: ⟨∂KL/∂W, W_b − W_a⟩ + ½ (W_b − W_a)ᵀ F (W_b − W_a)."""
    r = rungs[name]
    return grads[name][b] - grads[name][a] + _quadratic(curv, name, r.types[a], r.types[b])


def candidate_moves(rungs: Mapping[str, Rungs], current: Mapping[str, int], grads: Mapping[str, Sequence[float]],
                    total: int, lo: float, hi: float, pinned: set[str], tried: set[str],
                    curv: Mapping[str, dict] | None = None) -> list[Move]:
    """Every one-rung move and up/down pair that fits [min(lo, total), hi], most promising first
    by predicted ΔKL (ties: fewer bytes, then name)."""
    ups, downs = [], []
    for n, r in rungs.items():
        if n in pinned:
            continue
        k = current[n]
        if k + 1 < len(r.types) and r.sizes[k + 1] > r.sizes[k]:
            ups.append((predicted(rungs, grads, curv, n, k, k + 1), n, k, k + 1, r.sizes[k + 1] - r.sizes[k]))
        if k > 0 and r.sizes[k - 1] < r.sizes[k]:
            downs.append((predicted(rungs, grads, curv, n, k, k - 1), n, k, k - 1, r.sizes[k - 1] - r.sizes[k]))
    lo = min(lo, total)
    moves: list[Move] = []
    # Every move that fits is a candidate, predicted gains first: the prediction only orders the
    # measurements (it ignores how tensors interact), the measurement decides.
    for d, n, a, b, db in ups + downs:
        if lo <= total + db <= hi:
            moves.append(Move(((n, a, b),), d, db))
    ups.sort(key=lambda x: (x[0], x[4], x[1]))
    downs.sort(key=lambda x: (x[0], -x[4], x[1]))
    U, D = ups[:PAIR_UPS], downs[:PAIR_DOWNS]
    if U and D:
        du = np.array([u[0] for u in U])[:, None]
        dd = np.array([d[0] for d in D])[None, :]
        bu = np.array([u[4] for u in U])[:, None]
        bd = np.array([d[4] for d in D])[None, :]
        same = np.array([[u[1] == d[1] for d in D] for u in U])
        new_total = total + bu + bd
        ok = (new_total <= hi) & (new_total >= lo) & ~same
        for i, j in zip(*np.nonzero(ok)):
            u, d = U[i], D[j]
            moves.append(Move(((u[1], u[2], u[3]), (d[1], d[2], d[3])), float(du[i, 0] + dd[0, j]), int(u[4] + d[4])))
    moves = [m for m in moves if m.key not in tried]
    moves.sort(key=lambda m: (m.predicted, m.dbytes, m.key))
    return moves


def search_key(start_types: Mapping[str, str], held: HeldAside, settings: Mapping) -> str:
    h = hashlib.sha256()
    h.update(json.dumps(sorted(start_types.items())).encode())
    h.update(held.tokens.numpy().tobytes())
    h.update(json.dumps(settings, sort_keys=True).encode())
    return h.hexdigest()[:16]


def local_search(
    rungs: Mapping[str, Rungs], start: Mapping[str, int], held: HeldAside, *, lo: float, hi: float, max_evals: int,
    pinned: set[str] = frozenset(), journal_path: Path | None = None, write_journal: bool = True, key: str = "",
    reprobe_every: int = 4,
    start_measurement: Measurement | None = None, on_eval: Callable[[SearchEvent], None] | None = None,
    curvature: Mapping[str, dict] | None = None, margin: float = 0.0,
) -> SearchResult:
    """Greedy first-improvement local search from `start` (tensor -> rung), at most `max_evals`
    measurements. Leaves the student serving the result. The journal at `journal_path` is resumed
    from, and with `write_journal` written after every measurement (a tensor-parallel rank other
    than 0 reads it and leaves the writing to rank 0)."""
    current = dict(start)
    tried: set[str] = set()
    accepted: list[dict] = []
    evals = probes = 0
    resumed = False
    serve(rungs, current)
    cur = start_measurement
    first = None
    state = _load(journal_path, key, rungs)
    if state is not None:
        current, tried, accepted, evals, probes = state["current"], set(state["tried"]), state["accepted"], state["evals"], state["probes"]
        cur = Measurement(state["kl"], tuple(state["per_sequence"]))
        first = Measurement(state["start_kl"], tuple(state["start_per_sequence"]))
        serve(rungs, current)
        resumed = True
        log.info("search: resuming from %s after %d evaluation(s)", journal_path, evals)
    m0 = held.measure()  # the start, in full: commits every layer's output for the prefix replay
    held.commit()
    if cur is None or resumed:
        cur = m0
    first = first or cur
    total = total_bytes(rungs, current)

    def save() -> None:
        if journal_path is None or not write_journal:
            return
        fileio.write_json(journal_path, {
            "version": JOURNAL_VERSION, "key": key, "current": types_of(rungs, current), "kl": cur.kl,
            "per_sequence": list(cur.per_sequence), "start_kl": first.kl, "start_per_sequence": list(first.per_sequence),
            "tried": sorted(tried), "accepted": accepted, "evals": evals, "probes": probes,
        })

    while evals < max_evals:
        grads = held.probe(rungs, current)
        probes += 1
        moves = candidate_moves(rungs, current, grads, total, lo, hi, pinned, tried, curvature)
        if not moves:
            break
        took = 0
        touched: set[str] = set()
        for mv in moves:
            if evals >= max_evals:
                break
            if any(n in touched for n, _, _ in mv.changes) or not total + mv.dbytes <= hi:
                continue  # its prediction is stale, or it no longer fits: the next probe re-ranks it
            if total + mv.dbytes < min(lo, total):
                continue
            for n, _, b in mv.changes:
                current[n] = b
            serve({n: rungs[n] for n, _, _ in mv.changes}, current)
            m = held.measure(from_layer=_first_layer(mv))
            evals += 1
            if improves(cur, m, margin):
                held.commit()
                accepted.append({
                    "changes": [[n, rungs[n].types[a], rungs[n].types[b]] for n, a, b in mv.changes],
                    "bytes": mv.dbytes, "kl_before": cur.kl, "kl_after": m.kl, "predicted": mv.predicted,
                })
                cur = m
                total += mv.dbytes
                touched.update(n for n, _, _ in mv.changes)
                took += 1
            else:
                for n, a, _ in mv.changes:
                    current[n] = a
                serve({n: rungs[n] for n, _, _ in mv.changes}, current)
                tried.add(mv.key)
            save()
            if on_eval:
                on_eval(SearchEvent(evals, max_evals, cur.kl, len(accepted), total))
            if took >= reprobe_every:
                break
        if took == 0:
            break  # every move predicted to help was measured and none did
    save()
    return SearchResult(current, first, cur, evals, probes, total, accepted, resumed)


@dataclass
class Confirmation:
    """The search's start and result measured on the confirmation split (same sequences, paired)."""

    start: Measurement
    final: Measurement

    @property
    def kept(self) -> bool:
        return improves(self.start, self.final)

    def summary(self) -> dict:
        d = np.asarray(self.start.per_sequence, dtype=np.float64) - np.asarray(self.final.per_sequence, dtype=np.float64)
        se = float(d.std(ddof=1)) / len(d) ** 0.5 if len(d) > 1 else 0.0
        return {"sequences": len(d), "start_kl": self.start.kl, "final_kl": self.final.kl, "drop": float(d.mean()),
                "drop_stderr": se, "kept": self.kept}


def confirm(rungs: Mapping[str, Rungs], start: Mapping[str, int], final: Mapping[str, int], held: HeldAside) -> Confirmation:
    """Measure `start` and `final` (tensor -> rung) on `held`, sequences the search never measured
    on; the result is kept when its KL there is lower (``Confirmation.kept``). Leaves the student
    serving `final`."""
    serve(rungs, start)
    a = held.measure()
    serve(rungs, final)
    return Confirmation(a, held.measure())


def improves(before: Measurement, after: Measurement, margin: float = 0.0) -> bool:
    """Whether `after` is a gain over `before`: its mean KL is lower, and with `margin` z > 0 the
    drop exceeds z standard errors of the per-sequence drops (the two measured on the same sequences)."""
    if not after.kl < before.kl:
        return False
    if margin <= 0 or len(before.per_sequence) != len(after.per_sequence) or len(after.per_sequence) < 2:
        return True
    d = np.asarray(before.per_sequence, dtype=np.float64) - np.asarray(after.per_sequence, dtype=np.float64)
    se = float(d.std(ddof=1)) / len(d) ** 0.5
    return float(d.mean()) > margin * se


def _first_layer(mv: Move) -> int:
    """The first decoder layer a move changes (0 when it changes a tensor outside the layers)."""
    layers = [layer_of(n) for n, _, _ in mv.changes]
    return 0 if any(x is None for x in layers) else min(layers)


def _load(path: Path | None, key: str, rungs: Mapping[str, Rungs]) -> dict | None:
    if path is None or not path.is_file():
        return None
    try:
        d = json.loads(path.read_text())
    except (OSError, ValueError):
        log.warning("search journal %s is unreadable; starting the search over", path)
        return None
    if d.get("version") != JOURNAL_VERSION or d.get("key") != key or set(d.get("current", {})) != set(rungs):
        log.info("search journal %s was made from other inputs; starting the search over", path)
        return None
    try:
        d["current"] = {n: rungs[n].index(t) for n, t in d["current"].items()}
    except ValueError:
        return None
    return d
