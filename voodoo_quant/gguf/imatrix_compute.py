"""Computing an importance matrix in torch: the sums of squared activations entering every mapped
``nn.Linear``, gathered by forward hooks over calibration batches, as llama-imatrix gathers them
(:func:`compute_imatrix`). The :class:`~voodoo_quant.gguf.imatrix.Imatrix` it returns, and its file
formats, are :mod:`voodoo_quant.gguf.imatrix`'s.
"""

from __future__ import annotations

from typing import Callable, Iterable

import numpy as np

from .imatrix import Entry, Imatrix, ImatrixMismatchError

# llama-imatrix ignores matmuls over fewer than 16 rows (tools/imatrix/imatrix.cpp
# collect_imatrix: "src1->ne[1] < 16"); compute_imatrix follows it.
MIN_ROWS_PER_CALL = 16


class _HeadReached(Exception):
    """Raised just before the output head runs, when no imatrix entry reads its input."""


def _stop_before_unrecorded_head(model, hooked: set[int]):
    """A pre-hook on the model's output head (``get_output_embeddings()``, HF's name for it) that
    ends the forward there, unless the head is one of the `hooked` modules (ids); None when the
    model names no head."""
    get = getattr(model, "get_output_embeddings", None)
    head = get() if callable(get) else None
    if head is None or id(head) in hooked:
        return None

    def stop(_mod, _inputs):
        raise _HeadReached

    return head.register_forward_pre_hook(stop)


def compute_imatrix(
    model,
    token_batches: Iterable,
    name_map: Callable[[str], str | None],
    *,
    column_perm: Callable[[str], np.ndarray | None] | None = None,
    chunk_size: int | None = None,
    datasets: Iterable[str] = (),
    min_rows: int = MIN_ROWS_PER_CALL,
) -> Imatrix:
    """Sum of x² per input column of every ``nn.Linear`` whose HF name `name_map` maps to a
    GGUF name, over `token_batches` (LongTensor ``[batch, seq]`` each).

    For a Linear with weight ``(out, in)`` the ggml matmul's columns (ne[0]) are its `in`
    features. llama.cpp's converters permute rows of most tensors (q/k rope permutes), which
    leaves the columns alone; a converter that permutes the *input* columns (Qwen3.5
    ``linear_attn.out_proj``: conversion/qwen.py ``_reorder_v_heads`` on dim 1) needs
    `column_perm(hf_name)` → index array such that ``gguf_column[j] = hf_column[perm[j]]``.

    Accumulation is in float64 per call (more accurate than llama-imatrix's running float32;
    activations from torch differ from ggml's anyway) and stored as float32 like its file.
    Calls with fewer than `min_rows` rows are skipped, as llama-imatrix skips them.

    The output head does not run when no entry reads its input (llama-imatrix records none for
    it): its logits are a vocabulary-wide matmul per token that nothing here uses, 15 % of the
    multiply-adds of a Qwen2.5-1.5B forward (233 M of 1,544 M per token) (:func:`_stop_before_unrecorded_head`).
    """
    import torch

    sums: dict[str, torch.Tensor] = {}
    counts: dict[str, int] = {}
    owners: dict[str, str] = {}
    hooks = []
    hooked: set[int] = set()

    def make_hook(hf_name: str, gguf_name: str):
        def hook(_mod, inputs, _out):
            x = inputs[0].detach()
            x = x.reshape(-1, x.shape[-1])
            if x.shape[0] < min_rows:
                return
            s = x.to(torch.float64).square().sum(0).cpu()
            if gguf_name in sums:
                sums[gguf_name] += s
            else:
                sums[gguf_name] = s
            counts[gguf_name] = counts.get(gguf_name, 0) + int(x.shape[0])

        return hook

    for hf_name, mod in model.named_modules():
        if not isinstance(mod, torch.nn.Linear):
            continue
        g = name_map(hf_name + ".weight")
        if g is None:
            continue
        if g in owners:
            # Tied/shared modules would double-count: refuse rather than guess.
            raise ImatrixMismatchError(f"modules {owners[g]} and {hf_name} both map to {g}")
        owners[g] = hf_name
        hooked.add(id(mod))
        hooks.append(mod.register_forward_hook(make_hook(hf_name, g)))
    if not hooks:
        raise ImatrixMismatchError("no nn.Linear of the model maps to a GGUF tensor name")
    stop = _stop_before_unrecorded_head(model, hooked)
    if stop is not None:
        hooks.append(stop)

    n_tokens = 0
    try:
        was_training = model.training
        model.eval()
        with torch.no_grad():
            for batch in token_batches:
                batch = torch.as_tensor(batch)
                if batch.ndim == 1:
                    batch = batch[None]
                try:
                    model(input_ids=batch.to(next(model.parameters()).device))
                except _HeadReached:
                    pass  # every recorded Linear has run: the rest is the head's logits
                n_tokens += batch.numel()
        model.train(was_training)
    finally:
        for h in hooks:
            h.remove()

    entries = {}
    for g, hf_name in owners.items():
        if g not in sums:
            continue
        v = sums[g].numpy()
        perm = column_perm(hf_name + ".weight") if column_perm else None
        if perm is not None:
            perm = np.asarray(perm)
            if sorted(perm.tolist()) != list(range(v.size)):
                raise ImatrixMismatchError(f"column permutation for {hf_name} is not a permutation of {v.size}")
            v = v[perm]
        entries[g] = Entry(v.astype(np.float32), np.array([counts[g]]))
    if not entries:
        raise ImatrixMismatchError(f"no Linear saw a call of >= {min_rows} rows; use longer sequences")
    cs = int(chunk_size) if chunk_size else 0
    return Imatrix(entries, datasets=list(datasets), chunk_count=(n_tokens // cs if cs else 0), chunk_size=cs)
