"""--target_size: the whole exported file is at most the size asked for, and close to it."""

import pytest

from voodoo_quant.core.errors import ConfigError
from voodoo_quant.core.sizes import parse_size

MENU = ("Q8_0", "Q5_K", "Q4_K", "Q2_K")


def test_sizes_parse_as_users_write_them():
    assert parse_size("1.2GB") == 1_200_000_000
    assert parse_size("800MiB") == 800 * 1024 ** 2
    assert parse_size("800 mib") == 800 * 1024 ** 2
    assert parse_size("123456") == 123456
    assert parse_size(4096) == 4096
    assert parse_size("1.5G") == 1_500_000_000
    assert parse_size("10KB") == 10_000
    for bad in ("", "GB", "1.2 parsecs", "-5MB", "0"):
        with pytest.raises(ConfigError, match="--target_size"):
            parse_size(bad, "--target_size")


def test_exactly_one_size_target():
    from voodoo_quant.training.config import TrainConfig

    with pytest.raises(ConfigError, match="exactly one"):
        TrainConfig(model="m", compression_ratio=0.5, target_size="1GB")
    with pytest.raises(ConfigError, match="not a size"):
        TrainConfig(model="m", target_size="big")
    assert TrainConfig(model="m", target_size="800MiB").target_size == "800MiB"


@pytest.fixture(scope="module")
def sized(imatrix_llama256_hf_dir, synthetic_run_inputs, tmp_path_factory):
    """(model dir, run root, the runs' common TrainConfig fields, a target inside what the menu
    reaches, the estimate of the rest of the file)."""
    from voodoo_quant.student.build import fixed_tensors
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.target_size import other_bytes
    from voodoo_quant.training.trainer import Trainer

    d = imatrix_llama256_hf_dir
    root = tmp_path_factory.mktemp("target_size")
    synthetic_run_inputs(d, root)
    common = dict(model=str(d), data_dir=str(root / "data"), imatrix=str(root / "imatrix.gguf"), seq_len=32,
                  batch_size=2, max_steps=2, candidate_types=MENU, error_compensation="none",
                  warm_start=False, polish=False, guarantee=False)  # the size is the point here
    # a target inside what the menu reaches: the rest of the file plus 60 % of the weights at Q8_0
    probe = Trainer(TrainConfig(compression_ratio=0.6, output_dir=str(root / "probe"), **common))
    run = probe.prepare(build=False)
    rest = other_bytes(d, run.plans, fixed_tensors(run.plans, None))
    target = rest + run.budget.fixed_bytes + int(0.6 * run.budget.q8_bytes)
    return d, root, common, target, rest


@pytest.fixture(scope="module")
def exported(sized):
    from voodoo_quant.tools.export import ExportConfig, export
    from voodoo_quant.training.config import TrainConfig
    from voodoo_quant.training.trainer import Trainer

    d, root, common, target, rest = sized
    cfg = TrainConfig(target_size=str(target), output_dir=str(root / "run"), **common)
    res = Trainer(cfg).train()
    out = export(ExportConfig(model=d, assignment=res.assignment_json, output_dir=root / "out",
                              imatrix=root / "imatrix.gguf", size_percent=60))
    return target, rest, res, out


@pytest.mark.slow
def test_the_dry_run_plans_the_budget_training_computes(sized):
    # `voodoo train --dry_run --target_size ...`: the same budget as the trainer's setup, from the same flags
    from voodoo_quant.cli.tp import parse_train_flags
    from voodoo_quant.memory.dry_run import dry_run
    from voodoo_quant.training.trainer import Trainer

    d, root, common, target, rest = sized
    flags = ["--model", str(d), "--data_dir", common["data_dir"], "--imatrix", common["imatrix"],
             "--output_dir", str(root / "dry"), "--seq_len", "32", "--batch_size", "2", "--max_steps", "2",
             "--candidate_types", *MENU, "--error_compensation", "none", "--no_warm_start", "--no_polish",
             "--no_guarantee", "--target_size", str(target)]
    planned = dry_run(parse_train_flags(flags + ["--dry_run"])).budget
    trained = Trainer(parse_train_flags(flags)).prepare(build=False).budget
    assert planned == trained
    # the rest of the file came off the target: the selectable tensors' upper bound fits what is left
    assert 0 <= target - rest - planned.fixed_bytes - planned.upper_bytes <= 2  # int() rounding
    # a weightless model directory cannot say what the rest of the file holds
    bare = root / "bare"
    bare.mkdir()
    (bare / "config.json").write_text((d / "config.json").read_text())
    with pytest.raises(ConfigError, match="--target_size needs"):
        dry_run(parse_train_flags(["--model", str(bare), "--output_dir", str(root / "dry2"),
                                   "--candidate_types", *MENU, "--target_size", str(target), "--dry_run"]))


@pytest.mark.slow
def test_the_file_is_at_most_the_target_and_close_to_it(exported):
    target, rest, res, out = exported
    size = out.path.stat().st_size
    selected = sum(t.nbytes for t in res.assignment.tensors.values())
    room = target - rest - out.fixed_bytes  # what the budget left the selectable tensors
    print(f"target {target:,} bytes, file {size:,} bytes ({size / target:.4f} of the target); selectable "
          f"tensors {selected:,} of the {room:,} left them ({selected / room:.4f}), fixed {out.fixed_bytes:,}")
    assert size <= target
    # the selectable tensors land within the dead zone below the upper bound (2 % tolerance)
    assert size >= 0.95 * target, (size, target)
    assert res.assignment.meta["target_size"] == target


@pytest.mark.slow
def test_the_rest_of_the_file_is_counted_from_above_and_tightly(exported):
    # what the file holds beside the selectable and fixed tensors, as written, against the estimate
    target, rest, res, out = exported
    selected = sum(t.nbytes for t in res.assignment.tensors.values())
    actual_rest = out.path.stat().st_size - selected - out.fixed_bytes
    print(f"rest of the file: estimated {rest:,} bytes, written {actual_rest:,}")
    assert actual_rest <= rest
    assert rest - actual_rest < 4096, (rest, actual_rest)  # export's keys' margin and the padding bound
