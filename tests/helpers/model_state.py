"""A loaded model's whole state, to show that a pass run on it in place left it as it was found."""

from __future__ import annotations

import torch


def state(model: torch.nn.Module) -> dict:
    """Everything a pass could change: the module tree, every parameter's and buffer's object,
    device, dtype, flag, storage and values, each module's mode and hooks (forward, backward)."""
    return {
        "modules": [(n, id(m), m.training, len(m._forward_hooks), len(m._forward_pre_hooks),
                     len(m._backward_hooks), len(m._backward_pre_hooks))
                    for n, m in model.named_modules()],
        "params": [(n, id(p), p.device, p.dtype, p.requires_grad, p.grad is None, p.untyped_storage().data_ptr(),
                    p.detach().clone())
                   for n, p in model.named_parameters(remove_duplicate=False)],
        "buffers": [(n, id(b), b.device, b.dtype, b.clone()) for n, b in model.named_buffers(remove_duplicate=False)],
    }


def same_state(a: dict, b: dict) -> bool:
    def plain(rows):
        return [tuple(x for x in r if not isinstance(x, torch.Tensor)) for r in rows]

    return (a["modules"] == b["modules"] and plain(a["params"]) == plain(b["params"])
            and plain(a["buffers"]) == plain(b["buffers"])
            and all(torch.equal(x[-1], y[-1]) for x, y in zip(a["params"] + a["buffers"], b["params"] + b["buffers"])))
