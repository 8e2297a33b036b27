"""Hardware detection with faked torch facts: CPU, CUDA, ROCm (several gfx archs)."""

from __future__ import annotations

import pytest
import torch

from voodoo_quant.core.errors import ConfigError, DeviceError
from voodoo_quant.hardware import (
    GPUInfo, TorchProbe, apply_env_defaults, attention_backend, detect, env_defaults, env_settings, host_env_defaults,
    probe_torch, resolve_device,
)


def cpu_probe(**kw) -> TorchProbe:
    return TorchProbe(torch_version="2.13.0+cpu", **kw)


def cuda_probe(n: int = 2) -> TorchProbe:
    gpus = tuple(GPUInfo(i, "NVIDIA H100 80GB HBM3", 80 << 30, None, (9, 0)) for i in range(n))
    return TorchProbe("2.13.0+cu128", cuda_version="12.8", available=True, gpus=gpus)


def rocm_probe(*gcn: str) -> TorchProbe:
    gpus = tuple(GPUInfo(i, f"AMD GPU {i}", 64 << 30, a, None) for i, a in enumerate(gcn))
    return TorchProbe("2.13.0+rocm6.4", hip_version="6.4.43482", available=True, gpus=gpus)


def test_cpu_build_reason():
    a = detect(cpu_probe())
    assert a.kind == "cpu" and a.devices == () and a.dist_backend == "gloo"
    assert "CPU-only build" in a.reason and a.torch_build == "CPU"


def test_gpu_build_without_device_names_visibility():
    p = TorchProbe("2.13.0+cu128", cuda_version="12.8", available=False, visibility={"CUDA_VISIBLE_DEVICES": ""})
    a = detect(p)
    assert a.kind == "cpu"
    assert "CUDA 12.8 build" in a.reason and "CUDA_VISIBLE_DEVICES=''" in a.reason


def test_driver_error_becomes_reason():
    p = TorchProbe("2.13.0+rocm6.4", hip_version="6.4", available=False, error="RuntimeError: hipErrorNoDevice")
    a = detect(p)
    assert a.kind == "cpu" and "hipErrorNoDevice" in a.reason and a.torch_build == "ROCm 6.4"


def test_cuda_detected():
    a = detect(cuda_probe(2))
    assert a.kind == "cuda" and a.devices == (0, 1) and a.arch == ("sm_90", "sm_90")
    assert a.collective_library == "NCCL" and a.dist_backend == "nccl"
    assert "torch.version.cuda=12.8" in a.reason and "cuda:1 NVIDIA H100" in a.reason


@pytest.mark.parametrize("gcn,base", [
    ("gfx90a:sramecc+:xnack-", "gfx90a"), ("gfx942:sramecc+:xnack-", "gfx942"),
    ("gfx1100", "gfx1100"), ("gfx1201", "gfx1201"),
])
def test_rocm_detected_with_arch(gcn, base):
    a = detect(rocm_probe(gcn))
    assert a.kind == "rocm" and a.arch == (base,) and a.collective_library == "RCCL"
    assert a.dist_backend == "nccl"  # RCCL is registered under torch's nccl name
    assert "torch.version.hip=" in a.reason and base in a.reason


@pytest.mark.parametrize("gcn,backends,flag", [
    ("gfx90a:sramecc+:xnack-", ("flash", "efficient", "math"), None),
    ("gfx942:sramecc+:xnack-", ("flash", "efficient", "math"), None),
    ("gfx1100", ("flash", "efficient", "math"), "1"),  # stable in 2.13, experimental before
    ("gfx1201", ("flash", "efficient", "math"), "1"),
    ("gfx1101", ("flash", "efficient", "math"), "1"),  # experimental in 2.13
    ("gfx908", ("math",), None),  # MI100: no AOTriton kernels
])
def test_rocm_attention_choice(gcn, backends, flag):
    c = attention_backend(detect(rocm_probe(gcn)))
    assert c.sdpa_backends == backends
    assert c.env.get("TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL") == flag
    assert c.reason.startswith("ROCm:") and gcn.split(":")[0] in c.reason


def test_mixed_rocm_archs_take_the_weakest():
    c = attention_backend(detect(rocm_probe("gfx942", "gfx908")))
    assert c.sdpa_backends == ("math",) and "gfx908" in c.reason


def test_cuda_and_cpu_attention_leave_torch_alone():
    for p in (cuda_probe(1), cpu_probe()):
        c = attention_backend(detect(p))
        assert c.sdpa_backends == () and c.env == {} and c.reason


def test_env_defaults_per_vendor():
    cuda = env_defaults(detect(cuda_probe(4)), local_world_size=4, cpu_count=32)
    assert cuda["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True"
    assert cuda["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "1"
    assert cuda["OMP_NUM_THREADS"] == "8" and cuda["VOODOO_QUANT_WORKERS"] == "8"
    assert "PYTORCH_HIP_ALLOC_CONF" not in cuda

    rocm = env_defaults(detect(rocm_probe("gfx1100")), local_world_size=1, cpu_count=16)
    assert rocm["PYTORCH_HIP_ALLOC_CONF"] == "expandable_segments:True"
    assert rocm["TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"] == "1"
    assert "PYTORCH_CUDA_ALLOC_CONF" not in rocm and rocm["OMP_NUM_THREADS"] == "16"
    assert "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL" not in env_defaults(detect(rocm_probe("gfx942")))

    cpu = env_defaults(detect(cpu_probe()), local_world_size=3, cpu_count=2)
    assert cpu == {"OMP_NUM_THREADS": "1", "VOODOO_QUANT_WORKERS": "1", "THP_MEM_ALLOC_ENABLE": "1"}
    assert all(cuda[k] == v for k, v in host_env_defaults().items())  # every vendor's ranks get the host's
    assert all(s.reason for s in env_settings(detect(rocm_probe("gfx1201")), cpu_count=4))
    with pytest.raises(ConfigError):
        env_settings(detect(cpu_probe()), local_world_size=0)


def test_env_defaults_never_touch_os_environ_and_user_wins(monkeypatch):
    monkeypatch.delenv("PYTORCH_CUDA_ALLOC_CONF", raising=False)
    import os

    d = env_defaults(detect(cuda_probe(1)), cpu_count=4)
    assert "PYTORCH_CUDA_ALLOC_CONF" not in os.environ
    child = {"OMP_NUM_THREADS": "3"}
    applied = apply_env_defaults(d, child)
    assert child["OMP_NUM_THREADS"] == "3" and "OMP_NUM_THREADS" not in applied
    assert child["PYTORCH_CUDA_ALLOC_CONF"] == "expandable_segments:True" == applied["PYTORCH_CUDA_ALLOC_CONF"]


def test_cli_applies_the_host_defaults_to_its_own_process_and_the_user_wins(monkeypatch):
    """`voodoo` sets huge-page allocation for itself before any command runs (torch reads it once,
    at its first large allocation); a value the user set is kept."""
    import os

    from voodoo_quant.cli import app as cli_app

    monkeypatch.setattr(cli_app, "app", lambda **kw: None)
    monkeypatch.delenv("THP_MEM_ALLOC_ENABLE", raising=False)
    cli_app.main()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "1"
    monkeypatch.setenv("THP_MEM_ALLOC_ENABLE", "0")
    cli_app.main()
    assert os.environ["THP_MEM_ALLOC_ENABLE"] == "0"


def test_resolve_device():
    cuda2, rocm1, cpu = detect(cuda_probe(2)), detect(rocm_probe("gfx942")), detect(cpu_probe())
    assert resolve_device(None, cpu) == torch.device("cpu")
    assert resolve_device("", cuda2) == torch.device("cpu")  # default is CPU even with GPUs
    assert resolve_device("CPU", cuda2) == torch.device("cpu")
    assert resolve_device("cuda", cuda2) == torch.device("cuda", 0)
    assert resolve_device("cuda:1", cuda2) == torch.device("cuda", 1)
    assert resolve_device("cuda:0", rocm1) == torch.device("cuda", 0)
    with pytest.raises(DeviceError, match=r"cuda:2.*available: cpu, cuda:0, cuda:1"):
        resolve_device("cuda:2", cuda2)
    with pytest.raises(DeviceError, match=r"no GPU is usable.*CPU-only build.*available: cpu$"):
        resolve_device("cuda", cpu)
    with pytest.raises(DeviceError, match=r"addressed as cuda"):
        resolve_device("rocm:0", rocm1)
    with pytest.raises(DeviceError, match=r"not 'cpu', 'cuda' or 'cuda:N'"):
        resolve_device("tpu", cuda2)


def test_real_probe_on_this_machine():
    # The real torch: whatever it is, detection gives a kind and a reason and cpu resolves.
    p = probe_torch({})
    a = detect(p)
    assert a.kind in ("cpu", "cuda", "rocm") and a.reason
    assert p.torch_version == torch.__version__
    assert (a.kind == "cpu") == (not torch.cuda.is_available())
