"""One tensor-parallel equivalence case, shared by the test (single process) and the torchrun
worker (each rank): tiny models of every TP adapter, one step's loss and gate gradients, and the
assignment baked after a short run.

    python -m torch.distributed.run --nproc_per_node 2 tests/helpers/tp_case.py ROOT OUT ARCH...

ROOT holds the models written by `build_models`; each rank writes OUT/rank<r>.pt. A case
"ARCH:lazy" runs with --lazy (packed candidate shards), "ARCH:guarantee" with the guarantee on,
"ARCH:search" with the guarantee and the search on, "ARCH:confirm" with the search's result
checked on a confirmation split, "ARCH:comp" with error compensation (--lazy),
and "ARCH:probe" measures and probes the held-aside objective directly (:func:`probe_case`).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch

ARCHS = ("llama", "qwen3", "qwen3_5", "lfm2")
# 32-weight blocks: 256-wide rows split in two keep whole blocks on each rank.
MENU = ("Q8_0", "Q5_0", "Q4_1", "Q4_0")


def build_models(root: Path, archs=ARCHS, tokenizer: Path | None = None) -> dict[str, Path]:
    """The tiny models; with `tokenizer` (an HF tokenizer dir, the SmolLM2 one) its files beside
    each model and its vocabulary size, so that llama.cpp's converter (export) can read them."""
    import shutil

    import transformers as T

    vocab = 512
    if tokenizer is not None:
        vocab = len(T.AutoTokenizer.from_pretrained(tokenizer))
    common = dict(vocab_size=vocab, hidden_size=256, intermediate_size=512, num_attention_heads=4,
                  num_key_value_heads=2, bos_token_id=1, eos_token_id=2, max_position_embeddings=128,
                  initializer_range=0.08)
    out = {}
    for arch in archs:
        torch.manual_seed(0)
        if arch == "llama":
            m = T.LlamaForCausalLM(T.LlamaConfig(num_hidden_layers=2, head_dim=64, tie_word_embeddings=True, **common))
        elif arch == "qwen3":  # untied head: the embedding and the head are split separately
            m = T.Qwen3ForCausalLM(T.Qwen3Config(num_hidden_layers=2, head_dim=64, tie_word_embeddings=False, **common))
        elif arch == "qwen3_5":
            m = T.Qwen3_5ForCausalLM(T.Qwen3_5TextConfig(
                num_hidden_layers=2, head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                linear_key_head_dim=64, linear_value_head_dim=64, tie_word_embeddings=True,
                layer_types=["linear_attention", "full_attention"], **common))
        else:
            m = T.Lfm2ForCausalLM(T.Lfm2Config(num_hidden_layers=2, layer_types=["conv", "full_attention"],
                                               tie_word_embeddings=True, **common))
        d = root / arch
        m.save_pretrained(d / "model")
        for f in (tokenizer.iterdir() if tokenizer is not None else ()):
            shutil.copy(f, d / "model" / f.name)
        (d / "data").mkdir(parents=True, exist_ok=True)
        g = torch.Generator().manual_seed(1)
        torch.save(torch.randint(0, 512, (8, 40), generator=g), d / "data" / "train_tokens.pt")
        out[arch] = d
    return out


def config(d: Path, out: Path, tp: int, **kw):
    from voodoo_quant.training.config import TrainConfig

    base = dict(model=str(d / "model"), data_dir=str(d / "data"), seq_len=32, batch_size=2, max_steps=3,
                compression_ratio=0.62, candidate_types=MENU, output_dir=str(out), tensor_parallel=tp,
                loss_chunk_size=24, lr=0.5,
                guarantee=False, search_evals=0,  # the bake alone on both sides, unless a case asks
                # what --error_compensation auto resolves to under TP, so one process builds the same candidates
                error_compensation="none")
    base.update(kw)
    return TrainConfig(**base)


def run_case(d: Path, out: Path, tp: int, **kw) -> dict:
    """Step 1's (CE, KL) and gate gradients, then a 3-step run's per-step losses and assignment."""
    from voodoo_quant.training.trainer import Trainer

    tr = Trainer(config(d, out / "grad", tp, **kw))
    run = tr.prepare()
    opt = torch.optim.Adam([mq.gates for mq in run.mixed.values()], lr=run.cfg.lr)
    m = tr._step(run, opt, 0)
    grads = {n: mq.gates.grad.detach().clone() for n, mq in run.mixed.items()}
    trainer = Trainer(config(d, out / "train", tp, **kw))
    res = trainer.train()
    held = {}
    if kw.get("error_compensation", "none") != "none":  # what this rank trained on at the written types
        for n, t in res.assignment.tensors.items():
            mq, plan = trainer.run.mixed[n], next(p for p in trainer.run.plans if p.name == n)
            if t.qtype in plan.menu.types:
                held[n] = mq.candidate(plan.menu.types.index(t.qtype)).detach().float().cpu().clone()
    return {"ce": m.ce, "kl": m.kl, "grads": grads, "table": run.sensitivity, "held": held,
            "compensation": res.assignment.compensation,
            "history": [(h.ce, h.kl, h.expected_bytes) for h in res.history],
            "choice": dict(sorted(res.bake.choice.items())), "total_bytes": res.bake.total_bytes,
            "written": {n: t.qtype for n, t in sorted(res.assignment.tensors.items())},
            "guarantee": res.assignment.meta.get("guarantee"), "off_menu": _off_menu(run)}


def _off_menu(run) -> dict:
    """The references with types off their tensors' menus, and the rungs each rank holds for them
    (bytes whole, or its shard's: student.ShardedPacked)."""
    by = {p.name: p for p in run.plans}
    refs = sorted(c.name for c in (run.references.candidates if run.references else ())
                  if any(t not in by[n].menu.types for n, t in c.types.items()))
    held = {f"{n}:{t}": type(b).__name__ for (n, t), b in sorted(run.extra_blobs.items())}
    return {"references": refs, "held": held}


# from the guarantee's winner, its references' off-menu rungs on the search's ladder
SEARCH = dict(guarantee=True, search_evals=8, search_sequences=2)
# the same, with one of those two sequences moved to the confirmation split (the quarter cap of 8)
CONFIRM = dict(SEARCH, search_sequences=1, search_confirm=1)


# error compensation on --lazy candidate shards: rank 0 collects the Hessians layer by layer
COMP = dict(lazy=True, error_compensation="gptq", compensation_sequences=5)


def probe_case(d: Path, out: Path, tp: int) -> dict:
    """The held-aside objective at the warm start's argmax: its measurement, the probe's
    first-order ΔKL of every one-rung move, and a measurement replaying the layers before the
    last decoder layer after one move there, against the same move measured in full."""
    from voodoo_quant.training.objective import HeldAside, TPHeldAside, layer_of
    from voodoo_quant.training.rungs import menu_rungs, release, serve
    from voodoo_quant.training.trainer import Trainer

    run = Trainer(config(d, out, tp, search_sequences=2, warm_start=True)).prepare()
    rungs = menu_rungs(run.plans, run.mixed)
    current = {n: mq.argmax() for n, mq in run.mixed.items()}
    if run.tp is not None:
        held = TPHeldAside(run.student, run.teacher, run.held_tokens, run.tp, device=run.device,
                           chunk_tokens=run.cfg.loss_chunk_size, sharded=run.tp_sharded)
    else:
        held = HeldAside(run.student, run.teacher, run.held_tokens, device=run.device,
                         chunk_tokens=run.cfg.loss_chunk_size)
    try:
        serve(rungs, current)
        m = held.measure()
        held.commit()
        probe = held.probe(rungs, current)
        last = max(layer_of(n) for n in rungs if layer_of(n) is not None)
        name = sorted(n for n in rungs if layer_of(n) == last)[0]
        moved = dict(current, **{name: (current[name] + 1) % len(rungs[name].types)})
        serve(rungs, moved)
        replayed = held.measure(from_layer=last)
        full = held.measure()
    finally:
        release(rungs)
    return {"kl": m.per_sequence, "probe": probe, "replayed": replayed.per_sequence, "full": full.per_sequence,
            "prefix": held._prefix_ok, "cached_teacher": bool(held._teacher)}


def main(argv: list[str]) -> None:
    import torch.distributed as dist

    from voodoo_quant.model import modeling

    root, out, archs = Path(argv[0]), Path(argv[1]), argv[2:]
    torch.set_num_threads(1)
    whole = []  # a rank reads shards and streams the sensitivity pass: it never loads the model whole
    real = modeling.load_model
    modeling.load_model = lambda *a, **k: whole.append(a) or real(*a, **k)
    results = {}
    for case in archs:  # "arch", "arch:lazy" or "arch:guarantee" (the guarantee measured across the ranks)
        arch, _, mode = case.partition(":")
        whole.clear()
        if mode == "probe":
            results[case] = probe_case(root / arch, out / case.replace(":", "-"), 2)
            continue
        modes = {"guarantee": {"guarantee": True}, "search": SEARCH, "confirm": CONFIRM, "comp": COMP}
        kw = modes.get(mode, {"lazy": mode == "lazy"})
        results[case] = run_case(root / arch, out / case.replace(":", "-"), 2, **kw)
        results[case]["whole_loads"] = len(whole)
    rank = dist.get_rank()
    torch.save(results, out / f"rank{rank}.pt")
    from voodoo_quant.distributed.parallel import leave

    leave()


if __name__ == "__main__":
    sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
    main(sys.argv[1:])
