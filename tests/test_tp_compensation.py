"""Error compensation under tensor parallelism (2 gloo ranks through torchrun, tiny models).

Rank 0 collects the Hessians one decoder layer at a time on its skeleton (the file one process
writes, byte for byte, on the CPU) and builds every compensated candidate from the whole tensor;
each rank trains on its shard of those bytes. Export recomputes nothing the ranks did not train
on: every exported tensor, split as the ranks split it, is what each rank held."""

from __future__ import annotations

import sys
from pathlib import Path

import numpy as np
import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent / "helpers"))
import tp_case  # noqa: E402
from test_parallel import _plans, _rank_results  # noqa: E402

from voodoo_quant.training.config import TrainConfig  # noqa: E402


@pytest.fixture(scope="module")
def tp_models(tmp_path_factory, smollm2_tok_dir):  # a tokenizer: export converts the model
    return tp_case.build_models(tmp_path_factory.mktemp("tp_comp_models"), archs=("llama", "qwen3_5"),
                                tokenizer=smollm2_tok_dir)


@pytest.fixture(autouse=True)
def _keep_torch_threads():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


def test_auto_is_gptq_under_tensor_parallelism_and_a_plain_journal_is_another_result():
    kw = dict(model="m", compression_ratio=0.6, tensor_parallel=2)
    auto = TrainConfig(**kw)
    assert auto.compensation == "gptq" and TrainConfig(**kw, error_compensation="gptq").compensation == "gptq"
    assert auto.result_hash() == TrainConfig(**kw, error_compensation="gptq").result_hash()
    # a journal written where tensor-parallel auto meant none holds gates of plain candidates
    assert auto.result_hash() != TrainConfig(**kw, error_compensation="none").result_hash()


def _gguf_tensors(path: Path) -> dict[str, bytes]:
    from voodoo_quant.gguf import converter

    r = converter.vendored_gguf().GGUFReader(path)
    return {t.name: np.asarray(t.data).view(np.uint8).tobytes() for t in r.tensors}


@pytest.mark.slow
@pytest.mark.parametrize("arch", ["llama", "qwen3_5"])
def test_tp2_compensates_as_one_process_and_exports_what_the_ranks_trained_on(tp_models, tmp_path, arch, ggml_lib):
    from voodoo_quant.core import ggml
    from voodoo_quant.distributed.parallel import plan_tp
    from voodoo_quant.tools.export import ExportConfig, export

    case = f"{arch}:comp"
    ranks = _rank_results(tp_models, tmp_path, [case])
    d = tp_models[arch]
    one = tp_case.run_case(d, tmp_path / "one", 1, **tp_case.COMP)
    run_dir = tmp_path / "tp" / case.replace(":", "-") / "train"
    # rank 0 wrote the one-process file, and every rank records the same compensation
    assert (run_dir / "hessians.safetensors").read_bytes() == (tmp_path / "one" / "train" / "hessians.safetensors").read_bytes()
    recs = [r[case]["compensation"] for r in ranks]
    assert recs[0] == recs[1] and recs[0]["method"] == "gptq" and recs[0]["tensors"] > 0
    assert {k: v for k, v in recs[0].items() if k != "hessians"} == \
        {k: v for k, v in one["compensation"].items() if k != "hessians"}
    for r in ranks:  # the single process's assignment, trained on the same candidates
        assert r[case]["choice"] == one["choice"] and r[case]["written"] == one["written"]

    out = export(ExportConfig(model=d / "model", assignment=run_dir / "assignment.json", output_dir=tmp_path / "gguf",
                              output_name="tp.gguf"))
    got = _gguf_tensors(out.path)
    cfg, base, adapter, plans = _plans(d, 1, **tp_case.COMP)
    tp_plan = plan_tp(base, adapter, 2, plans)
    by = {p.name: p for p in plans}
    weights = dict(base.named_parameters(remove_duplicate=False))
    held = ranks[0][case]["held"]
    assert set(held) == set(ranks[1][case]["held"]) and len(held) == len(one["written"])
    split = compensated = 0
    for name, qtype in one["written"].items():
        p = by[name]
        blob = got[p.gguf_name]
        full = p.dequantize(blob, qtype)
        sh = tp_plan.shard_of(name)
        for r, res in enumerate(ranks):
            mine = full if sh is None else sh.take(full, r, 2)
            assert torch.equal(res[case]["held"][name], mine.float()), (name, r)
        split += sh is not None and sh.dim == 1
        plain = ggml.lib().quantize(p.layout.to_gguf(weights[name].detach().float()), qtype, None)
        compensated += blob != plain
    assert split > 0  # row-parallel tensors (o_proj, down_proj) among them, compensated with their whole input
    assert compensated == len(held)  # every tensor's bytes moved by compensation
