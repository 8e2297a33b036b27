"""Whether a causal LM's logits are its LM head applied to its base model's hidden states.

Where they are, the logits can be computed in pieces: chunks of tokens (training/losses.py, the
distillation losses), the teacher's cached hidden states (training/teacher_cache.py) or shards of
the vocabulary (distributed/parallel.py, tensor parallelism). :func:`chunk_reason` says why not
where they are not.
"""

from __future__ import annotations

import torch.nn as nn

# Config attributes that make `logits != lm_head(hidden)`; their presence (non-trivial) disables chunking.
LOGIT_TRANSFORMS = ("final_logit_softcapping", "attn_logit_softcapping_final", "logit_scale", "logits_scaling",
                    "output_multiplier_scale", "logit_softcapping", "mup_width_multiplier")


def _config_transforms_logits(config) -> str | None:
    for attr in LOGIT_TRANSFORMS:
        v = getattr(config, attr, None)
        if v not in (None, 0, 0.0, 1, 1.0, False):
            return attr
    return None


def chunk_reason(model: nn.Module) -> str | None:
    """None when the chunked path computes exactly the model's own logits, else why not."""
    head = model.get_output_embeddings() if hasattr(model, "get_output_embeddings") else None
    if head is None:
        return "the model has no output embedding (LM head)"
    if not isinstance(head, nn.Linear) and not is_routed_linear(head):
        return f"the LM head is a {type(head).__name__}, not a Linear"
    prefix = getattr(model, "base_model_prefix", None)
    if not prefix or not isinstance(getattr(model, prefix, None), nn.Module):
        return "the model exposes no base model to return hidden states"
    attr = _config_transforms_logits(getattr(model, "config", None))
    if attr is not None:
        return f"its config transforms the logits ({attr})"
    return None


def is_routed_linear(mod: nn.Module) -> bool:
    """Whether `mod` stands in for an ``nn.Linear``: while routing is active the training replaces
    a gated head by a ``RoutedModule`` (training/routing.py), which names the module it stands in
    for (``stands_in_for``)."""
    return isinstance(getattr(mod, "stands_in_for", None), nn.Linear)
