"""Layer-input Hessians for ``--error_compensation gptq`` (voodoo_quant/candidates/compensate.py).

H = Σ xᵀx over the inputs x of every planned Linear, on the first ``--compensation_sequences``
training sequences, from the float model before the gates replace its weights. Each batch adds
only the upper block triangle of xᵀx (:func:`add_gram_upper`, (B+1)/(2B) of the full product's
flops), and the lower triangle is mirrored from it once, when the Hessian is emitted
(:func:`finished`). Tensors that read the same input (q/k/v, gate/up) share one accumulator. A
tied embedding is compensated as the LM head it also is: its H is the head's input (the final
hidden states), where its rounding error reaches every logit; the lookup's share of the error is
left unweighted. Each H is stored in the GGUF tensor's column order, keyed by the HF tensor
name, in ``<output_dir>/hessians.safetensors`` (voodoo_quant/candidates/hessian_store.py); a
later run (or size of a ladder) with the same inputs reuses it, and export maps it, checked by its
sha256.

A run collects it one decoder layer at a time, in one forward over the text
(training/layer_hessians.py), from a loaded model (in place) or a skeleton (``--lazy``, tensor
parallelism). The whole-model collection here (:func:`collect_passes`: one forward per group of
accumulators that fits ``VOODOO_HESSIAN_PASS_GB``, written pass by pass) is the reference that
road equals byte for byte on the CPU, and what a loaded model that road refuses is collected by.
"""

from __future__ import annotations

import hashlib
import json
import logging
from typing import Sequence

import numpy as np
import torch
import torch.nn as nn
from ..core import envs

log = logging.getLogger(__name__)


def gguf_columns(layout) -> tuple[bool, np.ndarray | None]:
    """(whether the GGUF matrix's columns are the HF weight's input features, in which order: None
    = the same). False for a transposed, reshaped or generally permuted tensor."""
    inner = getattr(layout, "inner", None)
    if inner is None:  # IdentityLayout
        shape = tuple(getattr(layout, "shape", ()))
        return len(shape) == 2, None
    if inner.gather is not None or inner.transposed or len(inner.hf_shape) != 2:
        return False, None
    return True, None if inner.cols is None else np.asarray(inner.cols, dtype=np.int64)


def reader(plan, modules: dict[str, nn.Module]) -> str | None:
    """The module whose input the plan's Hessian is taken from: its one Linear, the other modules
    (if any) being lookups of the same rows (a tied embedding's Embedding beside its LM head)."""
    linear = [m for m in plan.modules if isinstance(modules.get(m), nn.Linear)]
    lookups = [m for m in plan.modules if isinstance(modules.get(m), nn.Embedding)]
    return linear[0] if len(linear) == 1 and len(linear) + len(lookups) == len(plan.modules) else None


def compensable(plan, modules: dict[str, nn.Module]) -> bool:
    """A plan read by one Linear (see :func:`reader`) whose input features are the GGUF rows' columns."""
    name = reader(plan, modules)
    if name is None:
        return False
    ok, _ = gguf_columns(plan.layout)
    return ok and modules[name].in_features == plan.layout.n_per_row


class Collection:
    """What :func:`collect_passes` will write: ``sizes`` (stored name → n, in the order the
    arrays come), ``shared`` (tensor → the stored name holding the Hessian it reads), ``passes``
    (how many forwards over the calibration text) and ``arrays`` (the iterator of (name, H))."""

    def __init__(self, sizes: dict[str, int], shared: dict[str, str], passes: int, arrays):
        self.sizes, self.shared, self.passes, self.arrays = sizes, shared, passes, arrays


def collect_passes(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, batch_size: int = 4,
                   pass_bytes: int | None = None, progress: bool = False) -> Collection:
    """The Hessian of every compensable plan's input, in GGUF column order, in as many passes
    over `tokens` as it takes for each pass's accumulators (on the model's device) to hold at most
    `pass_bytes` (``VOODOO_HESSIAN_PASS_GB``; one input larger than that gets a pass of its own).
    The arrays are produced lazily, one pass at a time."""
    modules = dict(model.named_modules())
    chosen = [p for p in plans if compensable(p, modules)]
    if not chosen:
        return Collection({}, {}, 0, iter(()))
    budget = envs.hessian_pass_bytes() if pass_bytes is None else int(pass_bytes)
    device = next(model.parameters()).device
    owner = shared_inputs(model, chosen, modules, tokens[:1, :8].to(device))
    sources = list(dict.fromkeys(owner[p.name] for p in chosen))
    width = {p.name: modules[reader(p, modules)].in_features for p in chosen}
    groups: list[list[str]] = []
    held = 0
    for src in sources:
        nbytes = 4 * width[src] ** 2
        if not groups or held + nbytes > budget:
            groups.append([])
            held = 0
        groups[-1].append(src)
        held += nbytes
    sizes, shared, order = stored_layout(chosen, owner, width)
    by_name = {p.name: p for p in chosen}

    def arrays():
        it = iter(order)
        pending = next(it, None)
        for gi, group in enumerate(groups):
            acc = _accumulate(model, {src: modules[reader(by_name[src], modules)] for src in group}, tokens,
                              batch_size, device, f"Hessians {gi + 1}/{len(groups)}" if progress else None)
            while pending is not None and pending[1] in group:
                name, src, cols = pending
                if src in acc:
                    h = finished(acc[src])
                else:  # never reached on this text (an unused expert): no column live, the plain bytes
                    h = np.zeros((width[src], width[src]), dtype=np.float32)
                yield name, in_gguf_order(h, cols)
                pending = next(it, None)
            del acc

    return Collection(sizes, shared, len(groups), arrays())


def stored_layout(chosen: Sequence, owner: dict[str, str], width: dict[str, int]
                  ) -> tuple[dict[str, int], dict[str, str], list[tuple[str, str, np.ndarray | None]]]:
    """(sizes, shared, order) of the file: one stored array per input, by its first reader (in the
    plans' order), in that reader's column order; a tensor reading it in a permuted order gets its
    own. `order` lists (stored name, source, columns) in the order the header declares them."""
    sources = list(dict.fromkeys(owner[p.name] for p in chosen))
    sizes: dict[str, int] = {}
    shared: dict[str, str] = {}
    stored_for: dict[str, str] = {}
    members: dict[str, list] = {src: [] for src in sources}
    for p in chosen:
        members[owner[p.name]].append(p)
    order: list[tuple[str, str, np.ndarray | None]] = []
    for src in sources:
        for p in members[src]:
            _, cols = gguf_columns(p.layout)
            if cols is None and src in stored_for:
                shared[p.name] = stored_for[src]
                continue
            if cols is None:
                stored_for[src] = p.name
            sizes[p.name] = width[src]
            order.append((p.name, src, cols))
    return sizes, shared, order


def in_gguf_order(h: np.ndarray, cols: np.ndarray | None) -> np.ndarray:
    return np.ascontiguousarray(h if cols is None else h[np.ix_(cols, cols)], dtype=np.float32)


# the narrowest column block of the Gram accumulation (:func:`gram_edges`): each block row is one
# GEMM of at least 768 × tokens × 768, at the kernel's full rate (on one thread of the 2-core machine,
# 512- and 768-wide blocks of a [2048, 1536] x ran at the full product's flop rate)
GRAM_BLOCK = 768


def gram_edges(n: int) -> list[int]:
    """The column edges the Gram accumulation of an n-wide input splits it at: B = max(1, n //
    GRAM_BLOCK) blocks, as equal as integers allow (each 768–1535 wide; n < 1536 is one block, the
    full product). At n = 1536 B = 2, at 8960 B = 11, at 17408 B = 22."""
    b = max(1, n // GRAM_BLOCK)
    return [i * n // b for i in range(b + 1)]


def gram_flops(tokens: float, n: int) -> float:
    """The flops :func:`add_gram_upper` spends on `tokens` rows of an n-wide input: block row i's
    2·tokens·w_i·(n − a_i), in all 2·tokens·n²·(B+1)/(2B) where B (``len(gram_edges(n)) - 1``)
    divides n, within 0.1 % of it elsewhere."""
    edges = gram_edges(n)
    return 2.0 * tokens * sum((b - a) * (n - a) for a, b in zip(edges[:-1], edges[1:]))


def add_gram_upper(acc: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Add the upper block triangle of xᵀx (x: [tokens, n]) to `acc` (n × n) in place, and return it.

    The n columns are split into B blocks (:func:`gram_edges`) and block row i gets x_iᵀ x[:, a_i:]
    (one GEMM, summed into `acc` by it): the blocks i ≤ j, (B+1)/(2B) of the full product's
    2·tokens·n² flops (0.75 at n = 1536, 0.545 at 8960). The blocks below the diagonal are not
    touched, and the diagonal blocks are whole; :func:`mirror_upper` makes the sum the symmetric H,
    once, when it is finished. The same x and `acc` give the same bytes: every collection (whole
    model, layer by layer, loaded or skeleton) adds through here."""
    edges = gram_edges(x.shape[1])
    for a, b in zip(edges[:-1], edges[1:]):
        acc[a:b, a:].addmm_(x[:, a:b].T, x[:, a:])
    return acc


def mirror_upper(h: torch.Tensor) -> torch.Tensor:
    """The finished sum of :func:`add_gram_upper` made symmetric in place, block by block (no second
    n × n buffer): below the diagonal blocks, and in each diagonal block below its diagonal, the
    transpose of what lies above. Returns `h`."""
    edges = gram_edges(h.shape[0])
    for i, (a, b) in enumerate(zip(edges[:-1], edges[1:])):
        d = h[a:b, a:b]
        d.copy_(torch.triu(d) + torch.triu(d, 1).T)
        for c, e in zip(edges[i + 1:-1], edges[i + 2:]):
            h[c:e, a:b] = h[a:b, c:e].T
    return h


def accumulating_hook(acc: dict[str, torch.Tensor], name: str):
    """A forward (or pre-) hook adding the upper block triangle of xᵀx (float32) of its module's
    input to ``acc[name]`` (:func:`add_gram_upper`; zeros before the first batch). What it holds is
    H once :func:`mirror_upper` has run on it."""
    def hook(mod, inp, out=None):
        x2 = inp[0].detach().reshape(-1, inp[0].shape[-1]).to(torch.float32)
        if name not in acc:
            acc[name] = x2.new_zeros(x2.shape[1], x2.shape[1])
        add_gram_upper(acc[name], x2)
    return hook


def finished(h: torch.Tensor) -> np.ndarray:
    """An accumulator of :func:`accumulating_hook`, made H (:func:`mirror_upper`, where it lies) and
    brought to the host as float32."""
    return mirror_upper(h).cpu().numpy()


def collect(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, batch_size: int = 4,
            pass_bytes: int | None = None, progress: bool = False) -> dict[str, np.ndarray]:
    """HF name → float32 Hessian of its input (GGUF column order) for every compensable plan, all
    in memory (:func:`collect_passes` streams them)."""
    c = collect_passes(model, plans, tokens, batch_size=batch_size, pass_bytes=pass_bytes, progress=progress)
    out = dict(c.arrays)
    for name, src in c.shared.items():
        out[name] = out[src]
    return out


def _accumulate(model: nn.Module, readers: dict[str, nn.Module], tokens: torch.Tensor, batch_size: int,
                device: torch.device, label: str | None) -> dict[str, torch.Tensor]:
    """Σ xᵀx (float32, on `device`) of each reader's input over `tokens`, its upper block triangle
    (:func:`accumulating_hook`: :func:`finished` makes it H)."""
    acc: dict[str, torch.Tensor] = {}
    hooks = [m.register_forward_hook(accumulating_hook(acc, src)) for src, m in readers.items()]
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            it = range(0, tokens.shape[0], batch_size)
            if label:
                from rich.progress import track

                it = track(it, description=label, transient=True)
            for i in it:
                model(tokens[i:i + batch_size].to(device))
    finally:
        for h in hooks:
            h.remove()
        model.train(was_training)
    return acc


def shared_inputs(model: nn.Module, chosen: Sequence, modules: dict[str, nn.Module], probe: torch.Tensor) -> dict[str, str]:
    """plan → the first plan that reads the very same input tensor (q/k/v, gate/up share one):
    found on a short probe forward that keeps every input alive, so no address is reused."""
    inputs: dict[str, torch.Tensor] = {}

    def keep(name: str):
        def hook(mod, inp, out) -> None:  # returns None: a forward hook's value would replace the output
            inputs.setdefault(name, inp[0])
        return hook

    hooks = [modules[reader(p, modules)].register_forward_hook(keep(p.name)) for p in chosen]
    try:
        with torch.no_grad():
            model(probe)
    finally:
        for h in hooks:
            h.remove()
    owner: dict[str, str] = {}
    leaders: list[tuple[str, torch.Tensor | None]] = []
    for p in chosen:
        x = inputs.get(p.name)
        lead = next((n for n, y in leaders if x is not None and y is x), None)
        if lead is None:
            leaders.append((p.name, x))
            lead = p.name
        owner[p.name] = lead
    return owner


# what `collect` measures; a file from an older collection (before the tied embedding was read at
# the LM head) is collected again rather than reused without it
COLLECTION = "inputs/2"


def hessian_key(plans: Sequence, tokens: torch.Tensor, model: str, weights_sha256: str) -> str:
    h = hashlib.sha256(COLLECTION.encode())
    h.update(json.dumps(sorted(p.name for p in plans)).encode())
    h.update(str(model).encode())
    h.update(tokens.to(torch.int64).contiguous().numpy().tobytes())
    h.update(weights_sha256.encode())
    return h.hexdigest()[:16]
