"""Scale-out: shards, refusals, lazy shards, --device_map, and tensor parallelism on CPU
with gloo: two torchrun ranks must reproduce the single-process loss, gate gradients and baked
assignment for a tiny model of every adapter that shards."""

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from voodoo_quant.arch.base import GenericAdapter
from voodoo_quant.core.errors import ConfigError
from voodoo_quant.distributed.device_map import split_layers
from voodoo_quant.distributed.parallel import Shard, plan_tp
from voodoo_quant.training.trainer import Trainer

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    """_rank_results leaves this process at one thread for its references; the next test file gets
    the thread count it started with (float32 sums depend on it)."""
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory):
    return tp_case.build_models(tmp_path_factory.mktemp("tp_models"))


def _plans(d, tp=1, **kw):
    from voodoo_quant.training.models import load_models
    from voodoo_quant.training.setup import plan_run

    cfg = tp_case.config(d, d / "unused", tp, **kw)
    base, _ = load_models(cfg, torch.float32)
    adapter, plans, _ = plan_run(cfg, base)
    return cfg, base, adapter, plans


# -- shards --------------------------------------------------------------------------------------
def test_shard_takes_matching_pieces_of_every_fused_group():
    sh = Shard.fused_rows((4, 2), (4, 2), (8, 4))  # [q | k | v] with heads of 2, 2 and 4 rows
    assert sh.index(0, 2).tolist() == [0, 1, 4, 5, 8, 9, 10, 11]
    assert sh.index(1, 2).tolist() == [2, 3, 6, 7, 12, 13, 14, 15]
    t = torch.arange(16.0).reshape(16, 1)
    assert torch.cat([sh.take(t, r, 2) for r in range(2)]).sort(0).values.flatten().tolist() == list(range(16))
    assert "do not split evenly" in Shard.rows(12, 4).why_not(2)  # 3 heads into 2 ranks
    assert Shard.rows(12, 4).why_not(3) is None


def test_vocab_shard_is_contiguous_and_may_be_uneven():
    sh = Shard.vocab(10)
    assert [sh.bounds(r, 3)[0] for r in range(3)] == [(0, 4), (4, 8), (8, 10)]
    assert sh.why_not(3) is None
    assert "empty" in Shard.vocab(4).why_not(3)  # ceil(4/3)=2: the third rank would get nothing


def test_split_layers_contiguous_and_refuses_more_devices_than_layers():
    assert split_layers(5, 2) == [0, 0, 0, 1, 1]
    assert split_layers(4, 4) == [0, 1, 2, 3]
    with pytest.raises(ConfigError, match="3 devices for 2 decoder layers"):
        split_layers(2, 3)


# -- refusals ------------------------------------------------------------------------------------
def test_tp_refuses_a_model_without_shard_layer(tp_models):
    _, base, _, plans = _plans(tp_models["llama"])
    with pytest.raises(ConfigError, match="needs an architecture adapter with shard_layer"):
        plan_tp(base, GenericAdapter(base.config), 2, plans)


def test_tp_refuses_heads_that_do_not_split(tp_models):
    _, base, adapter, plans = _plans(tp_models["llama"])
    with pytest.raises(ConfigError, match=r"--tensor_parallel 4 cannot split model\.layers\.0\.self_attn\.k_proj\.weight: "
                                          r"2 unit\(s\) of 64 do not split evenly into 4 ranks"):
        plan_tp(base, adapter, 4, plans)


def test_tp_refuses_a_split_inside_quantization_blocks(tp_models):
    # 256-weight K blocks: o_proj / down_proj rows of 256 / 512 split in two leave 128 / 256 per rank
    _, base, adapter, plans = _plans(tp_models["llama"], candidate_types=("Q8_0", "Q4_K"))
    with pytest.raises(ConfigError, match=r"cannot split model\.layers\.0\.self_attn\.o_proj\.weight on quantization blocks: "
                                          r"each rank would hold 128 of its 256 columns, not a multiple of Q4_K's block of 256"):
        plan_tp(base, adapter, 2, plans)


def test_tp_without_torchrun_says_how_to_launch(tp_models, tmp_path):
    for k in ("RANK", "WORLD_SIZE"):
        assert k not in os.environ
    with pytest.raises(ConfigError, match=r"runs under torchrun: use `voodoo tp --tensor_parallel 2"):
        Trainer(tp_case.config(tp_models["llama"], tmp_path, 2)).prepare()


# -- lazy shards ---------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", tp_case.ARCHS)
def test_lazy_shards_hold_only_their_bytes_and_equal_the_dense_shard(tp_models, arch):
    """Every rank's packed shard dequantizes to exactly the rank's slice of the whole candidate."""
    from voodoo_quant.student.build import (
        ShardedPacked, build_mixed, candidate_bytes, direct_quantize, selectable_weights,
    )

    _, base, adapter, plans = _plans(tp_models[arch])
    plan = plan_tp(base, adapter, 2, plans)
    weights = {n: w for n, (w, _) in selectable_weights(base).items()}
    checked = 0
    for p in plans:
        sh = next((plan.shard_of(n) for n in (p.name, *(f"{m}.weight" for m in p.modules)) if plan.shard_of(n)), None)
        if sh is None:
            continue
        blobs = candidate_bytes(p, weights[p.name], {}, direct_quantize)
        full = build_mixed(p, blobs, lazy=False, dtype=torch.float32)
        total = 0
        for r in range(2):
            sp = ShardedPacked.build(p, blobs, sh, r, 2, "cpu", torch.float32)
            if not sp.full_fallback:
                total += sp.nbytes
            for k in range(len(blobs)):
                assert torch.equal(sp(k), sh.take(full.candidate(k), r, 2)), (p.name, r, k)
        if total:
            assert total == sum(len(b) for b in blobs), p.name  # the shards' bytes add up to the tensor's, exactly
        checked += 1
    assert checked >= 10


# -- device map ----------------------------------------------------------------------------------
def test_device_map_cpu_cpu_equals_one_device(tp_models, tmp_path):
    d = tp_models["qwen3_5"]
    one = Trainer(tp_case.config(d, tmp_path / "one", 1)).train()
    two = Trainer(tp_case.config(d, tmp_path / "two", 1, device_map="cpu,cpu")).train()
    assert [(h.ce, h.kl, h.expected_bytes) for h in one.history] == [(h.ce, h.kl, h.expected_bytes) for h in two.history]
    assert one.bake.choice == two.bake.choice


def test_device_map_refused_with_tensor_parallel(tp_models, tmp_path):
    with pytest.raises(ConfigError, match="exclusive"):
        tp_case.config(tp_models["llama"], tmp_path, 2, device_map="cpu,cpu")


# -- tensor parallelism on CPU (gloo, 2 ranks through torchrun) ----------------------------------
def _torchrun(args, tmp_path):
    env = dict(os.environ, OMP_NUM_THREADS="1", VOODOO_QUANT_WORKERS="1")
    p = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node", "2", *args],
                       capture_output=True, text=True, env=env, cwd=ROOT, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    return p


def _rank_results(tp_models, tmp_path, cases) -> list[dict]:
    """Run `cases` (tests/helpers/tp_case.py) on 2 gloo ranks; each rank's results, in rank order.
    Leaves this process at one thread, as the ranks ran, for the single-process references."""
    root = Path(next(iter(tp_models.values()))).parent
    _torchrun([str(ROOT / "tests" / "helpers" / "tp_case.py"), str(root), str(tmp_path / "tp"), *cases], tmp_path)
    ranks = [torch.load(tmp_path / "tp" / f"rank{r}.pt", weights_only=True) for r in range(2)]
    torch.set_num_threads(1)
    return ranks


@pytest.mark.slow
def test_tp2_equals_single_process_for_every_adapter(tp_models, tmp_path):
    cases = [*tp_case.ARCHS, "qwen3_5:lazy", "lfm2:lazy"]
    ranks = _rank_results(tp_models, tmp_path, cases)
    refs = {}
    for case in cases:
        arch = case.split(":")[0]
        ref = refs.get(arch) or refs.setdefault(arch, tp_case.run_case(tp_models[arch], tmp_path / "one" / arch, 1))
        for r, res in enumerate(ranks):
            got = res[case]
            assert got["ce"] == pytest.approx(ref["ce"], rel=1e-5), (case, r)
            assert got["kl"] == pytest.approx(ref["kl"], rel=1e-4), (case, r)
            assert set(got["grads"]) == set(ref["grads"])
            for n, g in ref["grads"].items():
                # A gate gradient is a difference of nearly equal dot products, which the shards sum
                # in another order: 2.1e-4 of the largest entry measured (qwen3's LM head, on an AMD
                # EPYC host); a wrong or missing shard's contribution is off by the order of 1.
                tol = 5e-4 * float(g.abs().max()) + 1e-9
                assert float((got["grads"][n] - g).abs().max()) <= tol, (case, r, n)
            for (ce, kl, eb), (ce0, kl0, eb0) in zip(got["history"], ref["history"]):
                assert (ce, kl) == (pytest.approx(ce0, rel=1e-4), pytest.approx(kl0, rel=1e-3)), (case, r)
                assert eb == pytest.approx(eb0, rel=1e-6), (case, r)
            # rank 0 computed the warm start's Fisher table layer by layer on its skeleton (the
            # others read it): the single process's table, number for number, no whole-model load
            assert got["table"] == ref["table"], (case, r)
            assert got["whole_loads"] == 0, (case, r)
            assert got["choice"] == ref["choice"], (case, r)  # exactly the same assignment
            assert got["total_bytes"] == ref["total_bytes"]
        assert all(torch.equal(ranks[0][case]["grads"][n], ranks[1][case]["grads"][n]) for n in ranks[0][case]["grads"])


@pytest.mark.slow
def test_tp2_guarantee_measures_what_one_process_measures(tp_models, tmp_path):
    """Under TP the guarantee measures its candidates across the ranks (vocabulary-sharded KL on
    the held-aside sequences): the gates' bake, the knapsack and every reference, those with
    types off the menu too (a rank serves its shard of their bytes), get the single process's
    held-aside KL, the best one is written, and every rank agrees."""
    cases = ["llama:guarantee", "qwen3_5:guarantee"]
    ranks = _rank_results(tp_models, tmp_path, cases)
    for case in cases:
        arch = case.split(":")[0]
        ref = tp_case.run_case(tp_models[arch], tmp_path / "one" / arch, 1, guarantee=True)
        one = {c["name"]: c for c in ref["guarantee"]["candidates"]}
        for r, res in enumerate(ranks):
            g = res[case]["guarantee"]
            got = {c["name"]: c for c in g["candidates"]}
            assert {"gates", "gates+polish", "knapsack"} <= set(got), (case, r, sorted(got))
            assert set(got) == set(one), (case, r, sorted(got), sorted(one))  # off-menu references too
            assert res[case]["off_menu"]["references"], case  # which a rank once skipped
            assert "ShardedPacked" in res[case]["off_menu"]["held"].values(), case  # a split tensor's, sharded
            for name, c in got.items():
                assert c["bytes"] == one[name]["bytes"], (case, r, name)
                assert c["kl"] == pytest.approx(one[name]["kl"], rel=1e-4), (case, r, name)
            best = min(got.values(), key=lambda c: (c["kl"], c["bytes"], c["name"]))
            assert g["winner"] == best["name"] and g["search"] is None, (case, r)
            assert g["final_kl"] == got[g["winner"]]["kl"]
        assert ranks[0][case]["written"] == ranks[1][case]["written"]
        assert ranks[0][case]["guarantee"] == ranks[1][case]["guarantee"]  # the same values on every rank
        if ref["guarantee"]["winner"] in got and ref["guarantee"]["search"] is None:
            assert ranks[0][case]["written"] == ref["written"], case


@pytest.mark.slow
def test_tp2_held_aside_objective_and_probe_equal_one_process(tp_models, tmp_path):
    """The search's two measurements under TP: the held-aside KL (teacher hidden states kept,
    prefix replay on) and the probe's first-order ΔKL of every one-rung move (split tensors' inner
    products summed over the ranks) equal the single process's, to float summation order; the
    replayed measurement equals the full one; both ranks hold the very same numbers."""
    cases = ["llama:probe", "qwen3:probe", "qwen3_5:probe", "lfm2:probe"]
    ranks = _rank_results(tp_models, tmp_path, cases)
    for case in cases:
        arch = case.split(":")[0]
        ref = tp_case.probe_case(tp_models[arch], tmp_path / "one" / arch, 1)
        assert repr(ranks[0][case]) == repr(ranks[1][case]), case  # the same numbers on every rank (NaN marks too)
        got = ranks[0][case]
        assert got["prefix"] and got["cached_teacher"], case
        assert got["kl"] == pytest.approx(ref["kl"], rel=1e-4), case
        assert got["replayed"] == got["full"], case  # the replay is exact under TP too
        assert got["full"] == pytest.approx(ref["full"], rel=1e-4), case
        assert set(got["probe"]) == set(ref["probe"])
        scale = max(abs(v) for row in ref["probe"].values() for v in row if v == v)
        assert scale > 0
        for n, row in ref["probe"].items():
            g = got["probe"][n]
            assert [v != v for v in g] == [v != v for v in row], (case, n)  # the same rungs probed
            for a, b in zip(g, row):
                if b == b:
                    assert a == pytest.approx(b, rel=1e-4, abs=1e-6 * scale), (case, n, g, row)


@pytest.mark.slow
def test_tp2_search_runs_on_every_rank_and_takes_the_single_process_moves(tp_models, tmp_path):
    """Under TP the final search runs: every rank takes the same moves and
    writes the same assignment, each kept move lowered the measured KL, and the moves, the
    written assignment and the KLs are the single process's."""
    cases = ["llama:search", "qwen3_5:search"]
    ranks = _rank_results(tp_models, tmp_path, cases)
    kept = 0
    for case in cases:
        arch = case.split(":")[0]
        assert ranks[0][case]["guarantee"] == ranks[1][case]["guarantee"], case
        assert ranks[0][case]["written"] == ranks[1][case]["written"], case
        s = ranks[0][case]["guarantee"]["search"]
        assert s is not None and 0 < s["evals"] <= tp_case.SEARCH["search_evals"] and s["probes"] >= 1, case
        assert all(mv["kl_after"] < mv["kl_before"] for mv in s["moves"]), case
        kept += len(s["moves"])
        assert s["final_kl"] <= s["start_kl"]
        ref = tp_case.run_case(tp_models[arch], tmp_path / "one" / arch, 1, **tp_case.SEARCH)
        one = ref["guarantee"]["search"]
        assert [mv["changes"] for mv in s["moves"]] == [mv["changes"] for mv in one["moves"]], case
        assert ranks[0][case]["written"] == ref["written"], case
        assert s["final_kl"] == pytest.approx(one["final_kl"], rel=1e-4), case
        assert (s["evals"], s["probes"]) == (one["evals"], one["probes"]), case
    assert kept > 0  # the search moved something (llama: a pair), so the moves compared are not empty


@pytest.mark.slow
def test_tp2_confirmation_measures_what_one_process_measures(tp_models, tmp_path):
    """Under TP the search's result is checked on the confirmation split across the ranks: every
    rank gets the single process's start and result KLs there, takes the same decision (the
    result, or the start written) and writes the single process's assignment."""
    ranks = _rank_results(tp_models, tmp_path, ["llama:confirm"])
    ref = tp_case.run_case(tp_models["llama"], tmp_path / "one", 1, **tp_case.CONFIRM)
    one = ref["guarantee"]["search"]
    assert one["moves"] and "confirm" in one  # the search kept a move, so the confirmation ran
    assert ranks[0]["llama:confirm"]["guarantee"] == ranks[1]["llama:confirm"]["guarantee"]
    got = ranks[0]["llama:confirm"]["guarantee"]["search"]
    assert [mv["changes"] for mv in got["moves"]] == [mv["changes"] for mv in one["moves"]]
    c, c1 = got["confirm"], one["confirm"]
    assert c["sequences"] == c1["sequences"] == 1 and c["kept"] == c1["kept"]
    for k in ("start_kl", "final_kl", "drop"):
        assert c[k] == pytest.approx(c1[k], rel=1e-4, abs=1e-7), k
    assert ranks[0]["llama:confirm"]["written"] == ranks[1]["llama:confirm"]["written"] == ref["written"]


@pytest.mark.slow
def test_voodoo_tp_cli_runs_the_ranks_and_writes_the_single_process_assignment(tp_models, tmp_path):
    import json

    d = tp_models["lfm2"]
    flags = ["--model", str(d / "model"), "--data_dir", str(d / "data"), "--seq_len", "32", "--batch_size", "2",
             "--max_steps", "3", "--compression_ratio", "0.62", "--candidate_types", *tp_case.MENU,
             "--loss_chunk_size", "24", "--no_guarantee", "--search_evals", "0"]  # the bake on both sides
    env = dict(os.environ, OMP_NUM_THREADS="1", VOODOO_QUANT_WORKERS="1")
    p = subprocess.run([str(Path(sys.executable).with_name("voodoo")), "tp", "--tensor_parallel", "2", "--", *flags,
                        "--output_dir", str(tmp_path / "tp")], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "torch.distributed.run --standalone --nproc_per_node 2" in p.stdout
    # the flags' --error_compensation auto is gptq under TP too: rank 0 collected the one-process Hessians
    one = Trainer(tp_case.config(d, tmp_path / "one", 1, error_compensation="gptq")).train()
    assert (tmp_path / "tp" / "hessians.safetensors").read_bytes() == (tmp_path / "one" / "hessians.safetensors").read_bytes()
    got = json.loads((tmp_path / "tp" / "assignment.json").read_text())["tensors"]
    assert {n: t["qtype"] for n, t in got.items()} == {n: t.qtype for n, t in one.assignment.tensors.items()}


@pytest.mark.slow
def test_voodoo_tp_cli_with_the_defaults_reports_the_guarantee_it_measured(tp_models, tmp_path):
    """The recipe's path: `voodoo tp` with the guarantee at its defaults (no search). Rank 0 prints
    the measured candidates, and the assignment records the winner, which is the lowest measured
    KL, and is its file: no search ran, so no journal of one is written."""
    import json

    d = tp_models["llama"]
    flags = ["--model", str(d / "model"), "--data_dir", str(d / "data"), "--seq_len", "32", "--batch_size", "2",
             "--max_steps", "2", "--compression_ratio", "0.62", "--candidate_types", *tp_case.MENU,
             "--loss_chunk_size", "24", "--search_sequences", "2"]
    env = dict(os.environ, OMP_NUM_THREADS="1", VOODOO_QUANT_WORKERS="1")
    p = subprocess.run([str(Path(sys.executable).with_name("voodoo")), "tp", "--tensor_parallel", "2", "--", *flags,
                        "--output_dir", str(tmp_path / "tp")], capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    assert "never worse: measured on held-aside calibration sequences" in p.stdout
    assert "evaluation(s)" not in p.stdout
    g = json.loads((tmp_path / "tp" / "assignment.json").read_text())["meta"]["guarantee"]
    names = {c["name"] for c in g["candidates"]}
    assert {"gates", "gates+polish", "knapsack"} <= names
    best = min(g["candidates"], key=lambda c: (c["kl"], c["bytes"], c["name"]))
    assert g["winner"] == best["name"] and g["search"] is None and g["final_kl"] == best["kl"]
    assert not (tmp_path / "tp" / "search.json").exists()


@pytest.mark.slow
def test_voodoo_tp_search_killed_mid_way_resumes_on_every_rank(tp_models, tmp_path):
    """Rank 0 alone writes the search's journal; killed after its third write (the ranks die
    with it), the same command resumes the search on every rank from that journal (a rank that
    started over would leave its collectives unmatched, or bake another assignment, and fail)."""
    import json

    d = tp_models["llama"]
    flags = ["--model", str(d / "model"), "--data_dir", str(d / "data"), "--seq_len", "32", "--batch_size", "2",
             "--max_steps", "2", "--compression_ratio", "0.62", "--candidate_types", *tp_case.MENU,
             "--loss_chunk_size", "24", "--search_sequences", "2", "--search_evals", "8", "--no_guarantee",
             "--output_dir", str(tmp_path / "tp")]
    cmd = [str(Path(sys.executable).with_name("voodoo")), "tp", "--tensor_parallel", "2", "--", *flags]
    env = dict(os.environ, OMP_NUM_THREADS="1", VOODOO_QUANT_WORKERS="1")
    p = subprocess.run(cmd, capture_output=True, text=True, env={**env, "VOODOO_FAULT_AT": "write:search.json:3"},
                       timeout=900)
    assert p.returncode != 0 and not (tmp_path / "tp" / "assignment.json").exists()
    journal = json.loads((tmp_path / "tp" / "search.json").read_text())
    assert journal["evals"] == 2  # the third write died before its rename
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900)
    assert p.returncode == 0, (p.stdout + p.stderr)[-4000:]
    s = json.loads((tmp_path / "tp" / "assignment.json").read_text())["meta"]["guarantee"]["search"]
    assert s["resumed"] and 2 < s["evals"] <= 8
    assert json.loads((tmp_path / "tp" / "search.json").read_text())["evals"] == s["evals"]


def test_voodoo_tp_print_only_applies_the_vendor_defaults(tp_models, tmp_path):
    d = tp_models["llama"]
    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "VOODOO_QUANT_WORKERS")}
    p = subprocess.run([str(Path(sys.executable).with_name("voodoo")), "tp", "--tensor_parallel", "2", "--print_only", "--",
                        "--model", str(d / "model"), "--data_dir", str(d / "data"), "--compression_ratio", "0.6",
                        "--output_dir", str(tmp_path)], capture_output=True, text=True, env=env, timeout=120)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "[voodoo tp] OMP_NUM_THREADS=" in p.stdout
    assert "-m voodoo_quant.cli.app train" in p.stdout and "--tensor_parallel 2" in p.stdout
    assert not (tmp_path / "assignment.json").exists()


@pytest.mark.parametrize("args,msg", [
    (["--tensor_parallel", "1"], "--tensor_parallel must be >= 2"),
    (["--nproc", "1"], "--tensor_parallel must be >= 2"),  # the old spelling, a hidden alias, names the new one
    (["--tensor_parallel", "2", "--", "--model", "/nonexistent", "--compression_ratio", "0.5"], "no such model directory"),
    (["--tensor_parallel", "2", "--", "--model", "MODEL", "--compression_ratio", "0.5", "--tensor_parallel", "4"],
     "--tensor_parallel 4 (after `--`) disagrees with `voodoo tp --tensor_parallel 2`"),
])
def test_voodoo_tp_refuses_bad_launches_in_one_line(tp_models, args, msg):
    d = tp_models["llama"]
    argv = [a.replace("MODEL", str(d / "model")) for a in args]
    if argv[-1] == "1":
        argv += ["--", "--model", str(d / "model"), "--compression_ratio", "0.5"]
    p = subprocess.run([str(Path(sys.executable).with_name("voodoo")), "tp", *argv], capture_output=True, text=True, timeout=120)
    assert p.returncode != 0
    lines = [ln for ln in (p.stdout + p.stderr).splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:") and msg in lines[0], lines
    assert "Traceback" not in p.stderr


def test_process_group_waits_as_long_as_rank_zero_works(monkeypatch):
    """Rank 0 alone fills the candidate cache and computes the sensitivity table while the other
    ranks wait at a barrier; torch's default timeouts (NCCL: 10 minutes) would kill a large model's
    run there. The group is created with VOODOO_TP_TIMEOUT_MIN (default 240)."""
    import datetime

    import torch.distributed as dist

    from voodoo_quant.core.errors import EnvironmentVarError
    from voodoo_quant.distributed.parallel import TPContext

    seen = {}
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda backend, **kw: seen.update(backend=backend, **kw))
    monkeypatch.setattr(dist, "get_world_size", lambda: 2)
    monkeypatch.setattr(dist, "get_rank", lambda: 1)
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("VOODOO_TP_TIMEOUT_MIN", raising=False)
    assert TPContext.current(2, "gloo").rank == 1
    assert seen == {"backend": "gloo", "timeout": datetime.timedelta(minutes=240)}
    monkeypatch.setenv("VOODOO_TP_TIMEOUT_MIN", "90")
    TPContext.current(2, "gloo")
    assert seen["timeout"] == datetime.timedelta(minutes=90)
    monkeypatch.setenv("VOODOO_TP_TIMEOUT_MIN", "0")
    with pytest.raises(EnvironmentVarError, match="VOODOO_TP_TIMEOUT_MIN"):
        TPContext.current(2, "gloo")
