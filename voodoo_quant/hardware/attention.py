"""The scaled-dot-product-attention backend for the detected accelerator, with the reason.

On ROCm, torch's flash and memory-efficient SDPA kernels come from AOTriton. Whether an arch has
them, and whether they are "experimental" (refused unless ``TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL``
is set, with a one-time warning and a silent fall back to the slow math kernel), is decided in
``aten/src/ATen/native/transformers/cuda/sdp_utils.cpp`` (check_flash_attention_hardware_support).
The arch lists below are those of torch 2.13's own test table
(``torch/testing/_internal/common_cuda.py`` evaluate_platform_supports_flash_attention).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .detect import CPU, CUDA, Accelerator

AOTRITON_EXPERIMENTAL_ENV = "TORCH_ROCM_AOTRITON_ENABLE_EXPERIMENTAL"

# Supported without the flag in torch 2.13.
AOTRITON_STABLE = frozenset({"gfx90a", "gfx942", "gfx950", "gfx1100", "gfx1201"})
# Supported only with the flag in torch 2.13.
AOTRITON_EXPERIMENTAL = frozenset({"gfx1101", "gfx1102", "gfx1150", "gfx1151", "gfx1200"})


@dataclass(frozen=True)
class AttentionChoice:
    # Backends for torch.nn.attention.sdpa_kernel, in priority order ("flash", "efficient", "math");
    # empty = leave torch's own dispatch alone.
    sdpa_backends: tuple[str, ...]
    env: dict[str, str] = field(default_factory=dict)
    reason: str = ""


def _rocm_one(arch: str) -> tuple[str, str]:
    """('stable' | 'experimental' | 'none', why) for one gfx arch."""
    if arch in AOTRITON_STABLE:
        return "stable", f"{arch}: AOTriton flash/efficient kernels supported"
    if arch in AOTRITON_EXPERIMENTAL:
        return "experimental", f"{arch}: AOTriton kernels are experimental (need {AOTRITON_EXPERIMENTAL_ENV}=1)"
    if arch.startswith(("gfx11", "gfx12")):
        return "experimental", f"{arch}: RDNA3/4 arch not in torch 2.13's table; enabling AOTriton experimental kernels"
    return "none", f"{arch}: no AOTriton kernels for this arch; SDPA uses the math kernel"


def attention_backend(accel: Accelerator) -> AttentionChoice:
    if accel.kind == CPU:
        return AttentionChoice((), {}, "CPU: torch's own SDPA dispatch (its CPU flash kernel or math)")
    if accel.kind == CUDA:
        return AttentionChoice((), {}, "CUDA: torch picks cuDNN/flash/efficient by compute capability")
    verdicts = [_rocm_one(a) for a in dict.fromkeys(accel.arch)]
    levels = {v for v, _ in verdicts}
    why = "; ".join(w for _, w in verdicts)
    if "none" in levels:
        # One device without kernels: math everywhere keeps the ranks numerically alike.
        return AttentionChoice(("math",), {}, f"ROCm: {why}")
    env = {}
    if any(a.startswith(("gfx11", "gfx12")) for a in accel.arch):
        # gfx1100/gfx1201 are stable in torch 2.13 but were experimental in older AOTriton
        # releases; the flag is a no-op where an arch is stable, and without it an experimental
        # arch silently falls back to math (sdp_utils.cpp).
        env[AOTRITON_EXPERIMENTAL_ENV] = "1"
    return AttentionChoice(("flash", "efficient", "math"), env, f"ROCm: {why}")
