"""The measured-KL final search and the never-worse guarantee; the bake's costs are in test_bake_costs.py."""

import pytest
import torch

from voodoo_quant.core.errors import ConfigError
from voodoo_quant.experimental import search as S
from voodoo_quant.training.config import TrainConfig
from voodoo_quant.training.finalize import run_rungs
from voodoo_quant.training.objective import HeldAside
from voodoo_quant.training.rungs import menu_rungs, release, serve, total_bytes
from voodoo_quant.training.trainer import Trainer

MENU = ("Q8_0", "Q6_K", "Q4_K", "Q2_K")


def _cfg(d, out, **kw):
    base = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=2,
                compression_ratio=0.6, candidate_types=MENU, output_dir=str(out), partial_save_interval=1)
    base.update(kw)
    return TrainConfig(**base)


@pytest.fixture(scope="module")
def built(gate_model_dir, tmp_path_factory):
    tr = Trainer(_cfg(gate_model_dir, tmp_path_factory.mktemp("search")))
    tr.prepare()
    run = tr.run
    held = HeldAside(run.student, run.teacher, run.held_tokens, device=run.device)
    return tr, held


def _measure(rungs, held, choice):
    serve(rungs, choice)
    return held.measure().kl


def test_held_aside_split_is_not_trained_on(built):
    tr, _ = built
    run = tr.run
    full = torch.load(tr.cfg.data_path)[:, : tr.cfg.seq_len]
    n = run.held_tokens.shape[0]
    assert n == min(tr.cfg.search_sequences, full.shape[0] // 4) and n > 0
    assert torch.equal(run.held_tokens, full[-n:]) and torch.equal(run.tokens, full[:-n])
    assert run.confirm_tokens is None  # the search's split took the whole quarter of this small file


def test_confirmation_split_lies_before_the_search_split_and_shares_its_quarter():
    from voodoo_quant.training.setup import hold_aside

    tokens = torch.arange(40 * 3).view(40, 3)
    train, held, conf = hold_aside(tokens, 4, 3)
    assert torch.equal(held, tokens[-4:]) and torch.equal(conf, tokens[-7:-4]) and torch.equal(train, tokens[:-7])
    train, held, conf = hold_aside(tokens, 8, 8)  # a quarter is 10: the search keeps its 8, 2 are left
    assert held.shape[0] == 8 and torch.equal(conf, tokens[-10:-8]) and train.shape[0] == 30
    train, held, conf = hold_aside(tokens, 12, 8)
    assert held.shape[0] == 10 and conf is None and train.shape[0] == 30
    assert hold_aside(tokens, 0, 8) == (tokens, None, None)  # no search split, no confirmation
    with pytest.raises(ConfigError, match="--search_confirm"):
        TrainConfig(model="m", compression_ratio=0.6, search_confirm=-1)


def test_confirmation_keeps_a_better_result_and_rejects_a_worse_one(built):
    """Measured on other sequences than the search's: the better assignment is kept whichever
    side of the comparison it is on, and the report's numbers are those measurements."""
    tr, _ = built
    run = tr.run
    other = HeldAside(run.student, run.teacher, run.tokens[:2], device=run.device)
    rungs = menu_rungs(run.plans, run.mixed)
    good = {n: len(r.types) - 1 for n, r in rungs.items()}  # Q8_0 everywhere
    bad = {n: 0 for n in rungs}  # Q2_K everywhere
    try:
        up = S.confirm(rungs, bad, good, other)
        down = S.confirm(rungs, good, bad, other)
        kl_good, kl_bad = _measure(rungs, other, good), _measure(rungs, other, bad)
    finally:
        release(rungs)
    assert kl_good < kl_bad
    assert up.kept and not down.kept
    s = up.summary()
    assert (s["start_kl"], s["final_kl"], s["sequences"]) == (kl_bad, kl_good, 2)
    assert s["drop"] == pytest.approx(kl_bad - kl_good, rel=1e-9) and s["drop_stderr"] > 0
    assert down.summary()["drop"] == pytest.approx(-s["drop"], rel=1e-9)


def test_served_assignment_is_exactly_its_candidates(built):
    """Serving serves each rung's very candidate (what export writes), not a mixture."""
    tr, _ = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    choice = {n: len(r.types) - 1 for n, r in rungs.items()}
    serve(rungs, choice)
    try:
        mods = dict(run.student.named_modules())
        for p in run.plans:
            w = mods[p.modules[0]].weight
            assert torch.equal(w, run.mixed[p.name].candidate(choice[p.name]))
    finally:
        release(rungs)


def test_probe_is_the_gradient_of_the_held_aside_kl_and_keeps_no_logits_for_backward(built):
    """The probe's entry for rung j of tensor t is ⟨∂KL/∂W_t, W_tj − W_tk⟩ of the mean held-aside
    KL, here against autograd through one whole-vocabulary forward of all sequences at once. And
    the probe keeps no [tokens, vocab] tensor for its backward (each head chunk is recomputed), so
    a long sequence and a large vocabulary cost one chunk of logits, as in training."""
    import torch.nn.functional as F

    tr, held = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    current = {n: 1 for n in rungs}
    vocab = run.student.get_output_embeddings().weight.shape[0]
    saved = []

    def pack(t):
        saved.append(tuple(t.shape))
        return t
    try:
        with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
            got = held.probe(rungs, current)
        leaves = {}
        for n, r in rungs.items():
            leaves[n] = w = r.get(current[n]).detach().requires_grad_(True)
            r.mq.override = (None, (lambda _k, w=w: w), 1)
        ids = run.held_tokens.to(run.device)
        s_log = F.log_softmax(run.student(input_ids=ids).logits[:, :-1].float(), dim=-1)
        with torch.no_grad():
            t_log = F.log_softmax(run.teacher(input_ids=ids).logits[:, :-1].float(), dim=-1)
        (t_log.exp() * (t_log - s_log)).sum(-1).mean(-1).mean().backward()
    finally:
        release(rungs)
    s1 = run.held_tokens.shape[1] - 1  # one head chunk holds every position of a sequence here
    assert saved and (s1, vocab) not in saved  # no logits (student's or teacher's) kept for backward
    scale = max(abs(v) for row in got.values() for v in row if v == v)
    assert scale > 0
    for n, r in rungs.items():
        g = leaves[n].grad.double()
        for j in (0, 2):
            want = float((g * (r.get(j).double() - r.get(1).double())).sum())
            assert got[n][j] == pytest.approx(want, rel=1e-4, abs=1e-6 * scale), (n, j)
        assert got[n][1] == 0.0 and all(v != v for v in got[n][3:])


def test_a_lazy_served_student_holds_one_dequantized_weight_at_a_time(gate_model_dir, tmp_path, monkeypatch):
    """Under --lazy a measurement and the probe dequantize each served rung when its layer uses it
    and drop it after: at most a couple of dense weights are alive at once, not the model (which
    is what holding every served rung would cost)."""
    import weakref

    from voodoo_quant.training import rungs as R

    tr = Trainer(_cfg(gate_model_dir, tmp_path / "lazy", lazy=True))
    run = tr.prepare()
    held = HeldAside(run.student, run.teacher, run.held_tokens, device=run.device)
    rungs = menu_rungs(run.plans, run.mixed)
    refs, peak = [], [0]
    real = R.RungSource.__call__

    def tracked(self, i):
        w = real(self, i)
        refs.append(weakref.ref(w))
        peak[0] = max(peak[0], sum(r() is not None for r in refs))
        return w
    monkeypatch.setattr(R.RungSource, "__call__", tracked)
    try:
        serve(rungs, {n: 1 for n in rungs})
        m = held.measure()
        measured_peak, peak[0] = peak[0], 0
        held.probe(rungs, {n: 1 for n in rungs})
    finally:
        release(rungs)
    assert len(rungs) >= 10 and m.kl > 0
    assert measured_peak <= 2, measured_peak
    assert peak[0] <= 4, peak[0]  # the probe: one tensor's three rungs (and a tied head's use)


def test_search_finds_a_planted_better_assignment(built, tmp_path):
    """Start from a good assignment with its most sensitive tensor moved one rung down; the bytes
    for undoing that are the only slack. The search must measure its way back (or better)."""
    tr, held = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    good = {n: 2 for n in rungs}  # Q6_K everywhere (rungs: Q2_K Q4_K Q6_K Q8_0)
    kl_good = _measure(rungs, held, good)
    worst, worst_kl = None, -1.0
    for n in rungs:  # the tensor whose one-rung demotion hurts most (measured)
        kl = _measure(rungs, held, {**good, n: 1})
        if kl > worst_kl:
            worst, worst_kl = n, kl
    start = {**good, worst: 1}
    assert worst_kl > kl_good
    hi = total_bytes(rungs, good)
    try:
        res = S.local_search(rungs, start, held, lo=0, hi=hi, max_evals=40, journal_path=tmp_path / "s.json", key="k",
                             curvature=run.curvature)
    finally:
        release(rungs)
    assert res.start.kl == pytest.approx(worst_kl)
    assert res.final.kl <= kl_good * (1 + 1e-9), (res.final.kl, kl_good, res.accepted)
    assert res.accepted and res.total_bytes <= hi
    assert res.total_bytes == sum(rungs[n].sizes[k] for n, k in res.current.items())
    # every accepted move lowered the measured KL, in order
    kls = [m["kl_before"] for m in res.accepted] + [res.accepted[-1]["kl_after"]]
    assert all(a > b for a, b in zip(kls, kls[1:]))


def test_search_resumes_from_its_journal_and_keeps_pins(built, tmp_path):
    tr, held = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    start = {n: 1 for n in rungs}
    pinned = {n for n in rungs if n.endswith("down_proj.weight")}
    hi = total_bytes(rungs, start) * 1.3
    j = tmp_path / "search.json"
    try:
        first = S.local_search(rungs, start, held, lo=0, hi=hi, max_evals=3, pinned=pinned, journal_path=j, key="a")
        assert first.evals == 3 and j.is_file()
        again = S.local_search(rungs, start, held, lo=0, hi=hi, max_evals=8, pinned=pinned, journal_path=j, key="a")
        other = S.local_search(rungs, start, held, lo=0, hi=hi, max_evals=2, pinned=pinned, journal_path=j, key="b")
    finally:
        release(rungs)
    assert again.resumed and 3 < again.evals <= 8
    assert again.accepted[: len(first.accepted)] == first.accepted
    assert again.final.kl <= first.final.kl
    assert not other.resumed and other.evals <= 2  # another key: the journal is not reused
    for res in (first, again):
        assert all(res.current[n] == start[n] for n in pinned)
        assert all(ch[0] not in pinned for mv in res.accepted for ch in mv["changes"])


def test_training_writes_the_best_of_gates_and_references(gate_model_dir, tmp_path):
    tr = Trainer(_cfg(gate_model_dir, tmp_path / "run", search_evals=6))
    res = tr.train()
    g = res.assignment.meta["guarantee"]
    names = [c["name"] for c in g["candidates"]]
    assert names[0] == "gates" and "knapsack" in names and any(n.startswith("uniform ") for n in names)
    best = min(c["kl"] for c in g["candidates"])
    assert g["final_kl"] <= best  # never worse than any measured reference on the held-aside split
    assert g["search"]["evals"] <= 6
    b = tr.run.budget
    total = res.assignment.total_bytes
    assert total <= b.upper_bytes
    assert total == sum(t.nbytes for t in res.assignment.tensors.values())
    # the written assignment is the one measured: serve it and measure again
    held = HeldAside(tr.run.student, tr.run.teacher, tr.run.held_tokens, device=tr.run.device)
    rungs = run_rungs(tr.run)  # the menus and the references' off-menu types (a uniform file may win)
    for n, t in res.assignment.tensors.items():
        rungs[n].add(t.qtype, t.nbytes)
    try:
        kl = _measure(rungs, held, {n: rungs[n].index(t.qtype) for n, t in res.assignment.tensors.items()})
    finally:
        release(rungs)
    assert kl == pytest.approx(g["final_kl"], rel=1e-6)


def test_training_writes_the_search_result_only_where_the_confirmation_split_agrees(gate_model_dir, tmp_path):
    tr = Trainer(_cfg(gate_model_dir, tmp_path / "run", search_evals=16, search_sequences=2, search_confirm=1,
                      compression_ratio=0.75))  # a size where this model's search keeps a move
    res = tr.train()
    run = tr.run
    assert run.held_tokens.shape[0] == 2 and run.confirm_tokens.shape[0] == 1
    g = res.assignment.meta["guarantee"]
    s = g["search"]
    assert s["moves"], "the search kept no move: this test would check nothing"
    c = s["confirm"]
    from voodoo_quant.training.finalize import run_rungs

    rungs = run_rungs(run)  # a reference's off-menu type is served from its bytes, as the search served it
    for n, t in res.assignment.tensors.items():
        rungs[n].add(t.qtype, t.nbytes)
    written = {n: rungs[n].index(t.qtype) for n, t in res.assignment.tensors.items()}
    try:
        on_confirm = _measure(rungs, HeldAside(run.student, run.teacher, run.confirm_tokens, device=run.device), written)
        on_held = _measure(rungs, HeldAside(run.student, run.teacher, run.held_tokens, device=run.device), written)
    finally:
        release(rungs)
    # the file written is the search's result where the confirmation split agreed, else its start
    assert on_confirm == pytest.approx(c["final_kl"] if c["kept"] else c["start_kl"], rel=1e-6)
    assert on_held == pytest.approx(g["final_kl"], rel=1e-6)
    assert c["kept"] == (c["final_kl"] < c["start_kl"])
    if not c["kept"]:
        assert g["final_kl"] == next(x["kl"] for x in g["candidates"] if x["name"] == g["winner"])


def test_prefix_replay_measures_exactly_what_a_full_forward_does(built):
    tr, held = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    base = {n: 1 for n in rungs}
    late = next(n for n in rungs if ".layers.1." in n)
    try:
        serve(rungs, base)
        held.measure()
        held.commit()
        moved = {**base, late: 3}
        serve(rungs, moved)
        replayed = held.measure(from_layer=1)
        full = held.measure()
        assert replayed.per_sequence == full.per_sequence  # bitwise: the same layers, the same inputs
        # and the replay really skips work: a wrong claim (a change before layer 1) is not noticed
        early = next(n for n in rungs if ".layers.0." in n)
        serve(rungs, base)
        held.measure()
        held.commit()
        serve(rungs, {**base, early: 3})
        assert held.measure(from_layer=1).per_sequence != held.measure().per_sequence
    finally:
        release(rungs)


def test_margin_rejects_a_drop_that_the_sequences_disagree_on():
    from voodoo_quant.training.objective import Measurement

    before = Measurement(0.10, (0.10, 0.10, 0.10, 0.10))
    consistent = Measurement(0.09, (0.091, 0.089, 0.090, 0.090))  # every sequence gains ~0.01
    mixed = Measurement(0.09, (0.05, 0.14, 0.06, 0.11))  # same mean, two sequences worse
    worse = Measurement(0.11, (0.11, 0.11, 0.11, 0.11))
    assert S.improves(before, consistent) and S.improves(before, mixed)  # margin 0: any drop
    assert S.improves(before, consistent, margin=2.0)
    assert not S.improves(before, mixed, margin=1.0)
    assert not S.improves(before, worse) and not S.improves(before, worse, margin=1.0)
    with pytest.raises(ConfigError, match="--search_margin"):
        TrainConfig(model="m", compression_ratio=0.6, search_margin=-1.0)


def test_relaxation_gap_restores_the_one_hot_kl_the_mixture_hides(built):
    """KL(mixture) + gap predicts the mean KL of the one-hot files the mixture stands for; the
    mixture alone is optimistic (the gates drifted to cheap rungs by rewarding mixing)."""
    from voodoo_quant.experimental.relaxation import RelaxationGap

    tr, held = built
    run = tr.run
    rungs = menu_rungs(run.plans, run.mixed)
    top = {n: len(r.types) - 1 for n, r in rungs.items()}
    name = max(rungs, key=lambda n: rungs[n].sizes[-1])  # the largest tensor: its error dominates
    r = rungs[name]
    a, b = 1, 2  # Q4_K, Q6_K: errors small enough for the second-order picture (Q2_K on this tiny model is not)
    try:
        kls = []
        for k in (a, b):
            serve(rungs, {**top, name: k})
            kls.append(held.measure().kl)
        serve(rungs, top)
        wa, wb = r.get(a), r.get(b)
        r.mq.override = (torch.tensor([0.5, 0.5], dtype=torch.float64), lambda j: (wa, wb)[j], 2)
        mix = held.measure().kl
    finally:
        release(rungs)
    mq = run.mixed[name]
    gap = RelaxationGap({name: mq}, run.curvature)
    assert len(gap) == 1
    with torch.no_grad():
        saved, tau = mq.gates.clone(), mq.tau
        try:
            mq.tau = 1.0
            mq.gates.fill_(-30.0)
            ia, ib = mq.menu.index(r.types[a]), mq.menu.index(r.types[b])
            mq.gates[ia] = mq.gates[ib] = 0.0
            g = float(gap(torch.device("cpu")))
            mq.gates.fill_(-30.0)
            mq.gates[ia] = 0.0
            g_one_hot = float(gap(torch.device("cpu")))
        finally:
            mq.gates.copy_(saved)
            mq.tau = tau
    expected = 0.5 * (kls[0] + kls[1])
    assert mix < expected  # the mixture looks better than either file it could bake to
    assert g > 0 and abs(g_one_hot) < 1e-9 * max(1.0, g)
    assert abs(mix + g - expected) < 0.25 * abs(mix - expected)  # measured: 0.0015 vs 0.0114


def test_training_with_the_relaxation_gap_logs_and_descends_it(gate_model_dir, tmp_path):
    """--relaxation_gap: the gap term is in the loss (logged per step, > 0 while the gates are
    spread) and gets a gradient: the gates move differently than without it."""
    on = Trainer(_cfg(gate_model_dir, tmp_path / "on", relaxation_gap=True, search_evals=0, guarantee=False,
                      warm_start=False, polish=False))
    res = on.train()
    gaps = [m.relaxation_gap for m in res.history]
    assert gaps[0] > 0 and all(g >= 0 for g in gaps)
    off = Trainer(_cfg(gate_model_dir, tmp_path / "off", search_evals=0, guarantee=False, warm_start=False, polish=False))
    assert all(m.relaxation_gap == 0 for m in off.train().history)
    g_on = torch.stack([mq.gates.detach() for mq in on.run.mixed.values()])
    g_off = torch.stack([mq.gates.detach() for mq in off.run.mixed.values()])
    assert not torch.allclose(g_on, g_off)


def test_curvature_extended_to_reference_rungs_is_stored_for_the_next_run(gate_model_dir, tmp_path, monkeypatch):
    """The search's curvature over the references' off-menu types is saved with the table, so a
    second run from the same inputs (the next size of a ladder) needs no second Fisher pass."""
    import json as _json

    from voodoo_quant.core import fileio
    from voodoo_quant.training import layerwise
    from voodoo_quant.training.sensitivity import TABLE_NAME

    first = Trainer(_cfg(gate_model_dir, tmp_path / "a", search_evals=2))
    first.train()
    stored = _json.loads(fileio.torch_load(tmp_path / "a" / TABLE_NAME, what="table")["curvature_json"])
    menus = {p.name: set(p.menu.types) for p in first.run.plans}
    assert any(set(c["types"]) > menus[n] for n, c in stored.items())  # off-menu rungs are in it
    calls = []
    real = layerwise.layerwise_curvature  # the loaded model's pass, layer by layer in place
    monkeypatch.setattr(layerwise, "layerwise_curvature", lambda *a, **k: calls.append(1) or real(*a, **k))
    (tmp_path / "b").mkdir()
    fileio.write_bytes(tmp_path / "b" / TABLE_NAME, (tmp_path / "a" / TABLE_NAME).read_bytes())
    second = Trainer(_cfg(gate_model_dir, tmp_path / "b", search_evals=2))
    second.train()
    assert calls == []
    assert second.run.curvature == first.run.curvature
    # another seed draws the Fisher labels afresh: the stored table is not its table
    (tmp_path / "c").mkdir()
    fileio.write_bytes(tmp_path / "c" / TABLE_NAME, (tmp_path / "a" / TABLE_NAME).read_bytes())
    Trainer(_cfg(gate_model_dir, tmp_path / "c", search_evals=2, seed=1)).prepare()
    assert calls, "a table drawn with seed 0 was reused for seed 1"


def test_search_alone_computes_the_table_its_curvature_needs(gate_model_dir, tmp_path):
    """The search without the guarantee, warm start or polish still reads the sensitivity table
    (its moves are ranked with the table's curvature): it is computed for it. This combination of
    flags once stopped with an UnboundLocalError after loading."""
    cfg = _cfg(gate_model_dir, tmp_path / "run", search_evals=3, guarantee=False, warm_start=False, polish=False)
    assert cfg.needs_sensitivity and cfg.measures
    res = Trainer(cfg).train()
    g = res.assignment.meta["guarantee"]
    assert [c["name"] for c in g["candidates"]] == ["gates"]  # no references without the guarantee
    assert 0 < g["search"]["evals"] <= 3
    assert (tmp_path / "run" / "sensitivity.pt").is_file()


def test_tensor_parallel_runs_measure_the_guarantee_and_search():
    """Under --tensor_parallel the guarantee and the search run as in one process (their table
    and curvature computed on rank 0); with neither, nor warm start and polish, no table is computed."""
    k = dict(model="m", data_dir="d", compression_ratio=0.6, warm_start=False, polish=False)
    default = TrainConfig(**k)  # the guarantee only: no search unless asked for
    assert default.measures and not default.searches and default.needs_sensitivity
    k["search_evals"] = 8
    one = TrainConfig(**k)
    assert one.measures and one.searches and one.needs_sensitivity
    tp = TrainConfig(tensor_parallel=2, **k)
    assert tp.measures and tp.searches and tp.needs_sensitivity
    alone = TrainConfig(tensor_parallel=2, guarantee=False, **k)
    assert alone.measures and alone.searches and alone.needs_sensitivity  # the search alone
    k["search_evals"] = 0
    bare = TrainConfig(tensor_parallel=2, guarantee=False, **k)
    assert not bare.measures and not bare.needs_sensitivity
    assert TrainConfig(tensor_parallel=2, guarantee=False, **{**k, "warm_start": True}).needs_sensitivity
    assert TrainConfig(tensor_parallel=2, guarantee=False, relaxation_gap=True, **k).needs_sensitivity
    assert not TrainConfig(guarantee=False, **k).needs_sensitivity
