"""The Hessians of ``--error_compensation`` one decoder layer at a time, in one forward over the text.

The whole-model collection (:func:`.hessians.collect_passes`) runs the loaded float model over
the calibration text with hooks on the planned Linears, once per group of accumulators that fits
``VOODOO_HESSIAN_PASS_GB``: 3 forwards at 1.5B, dozens at 27B. This collection takes the
sensitivity pass's road (:mod:`.layerwise`) instead: one forward in total, holding one decoder
layer's accumulators. It runs on either kind of model, with one loop:

- a **skeleton** (``--lazy``, tensor parallelism: parameters on ``meta``, read by name through
  its ``WeightReader``) has each layer read (float32, onto `device`) while it runs and put back
  on ``meta`` after (:class:`_Read`);
- a **loaded** model is run in place, where its parameters are, in their dtype: nothing is read,
  moved or replaced (:class:`_InPlace`), and nothing is left changed on it.

1. **Which tensors share an input.** The same probe forward as the whole-model collection (the
   first 8 tokens of the first sequence). A loaded model runs it as it is; a skeleton on its own
   code, its embedding, norms and head read from the checkpoint and each decoder layer given zero
   weights while it runs: which Linear reads which tensor object does not depend on the weights'
   values (a router's choice does: in a mixture of experts built of Linears, an expert the probe
   reaches in one collection and not in the other has its shared input stored once in one file
   and per tensor in the other, the same values). The file's header (sizes, shared inputs) is
   then known before anything is collected.
2. **Record.** The embedding's output for every batch of the calibration text, and every layer's
   call arguments, with the layers replaced by recorders (:func:`.layerwise.record`).
3. **Layers.** Layer by layer: run without a graph on every batch with the hooks of the
   whole-model collection on its Linears, its output kept on the host as the next layer's input;
   its Hessians (each upper block triangle mirrored) written to the file (each at its declared offset:
   :func:`voodoo_quant.candidates.hessian_store.write_hessians`) and freed.
4. **Head.** The model's own code after the layers (final norm, LM head) on the last hidden
   states: the LM head's input (a tied embedding's Hessian) is taken as it enters the head, and
   no logits are computed.

The batches (``batch_size`` sequences) are the whole-model collection's, every product and every
sum is its, in its order: on the CPU the file is the same bytes, from a skeleton or a loaded
model (tests/test_lazy_compensation.py, tests/test_eager_hessians.py). A skeleton on an
accelerator is collected there, and its sums round as that device's kernels do. Peak memory: on
the host, the calibration batches' hidden states (``sequences × seq_len × hidden`` float32) and
one batch's output; where the layers run, that layer's n² float32 accumulators and one batch's
activations through it, plus, from a skeleton, one float32 decoder layer (or the embedding and
head) read (:func:`phase_bytes`).
"""

from __future__ import annotations

import contextlib
from typing import Iterator, Sequence

import numpy as np
import torch
import torch.nn as nn

from ..core.errors import ConfigError
from ..core.units import GB
from ..distributed.parallel import decoder_layers
from .hessians import (
    Collection, accumulating_hook, compensable, finished, in_gguf_order, reader, shared_inputs, stored_layout,
)
from .layerwise import (
    InPlace, LayerwiseUnsupported, Read, _buffers_to, _layer_index, _layers_replaced, _params, _release, evaluating,
    outside_buffers_to, record,
)

BATCH = 4  # sequences per forward: the whole-model collection's (hessians.collect_passes)


class _HeadReached(Exception):
    """Raised by the head's pre-hook once every input wanted after the layers is taken."""


def _unsupported(model: nn.Module, why: str) -> LayerwiseUnsupported:
    return LayerwiseUnsupported(f"the layer-by-layer Hessians of --error_compensation cannot be collected on "
                                f"{type(model).__name__}: {why}; run without --lazy (the float model read whole) "
                                "or with --error_compensation none", why)


class _Read(Read):
    """:class:`.layerwise.Read`, whose probe gives each decoder layer zero weights while it runs."""

    def probe(self):
        return _zero_layers(self.model, self.layers, self.prefix, self.originals, self.device)


class _InPlace(InPlace):
    """:class:`.layerwise.InPlace`: the probe runs on the real weights (the whole-model collection's)."""

    def probe(self):
        return contextlib.nullcontext()


def collect_layerwise(model: nn.Module, plans: Sequence, tokens: torch.Tensor, *, batch_size: int = BATCH,
                      device: torch.device | None = None, progress: bool = False) -> Collection:
    """What :func:`.hessians.collect_passes` gives for the loaded model, in one forward over
    `tokens`, one decoder layer at a time (module docstring); the arrays come layer by layer (the
    head's last). `model` is a skeleton (read onto `device`, default the CPU; left as it was
    found, every parameter back on ``meta``) or a loaded model (run in place on its own device;
    `device` is not used). Raises :class:`LayerwiseUnsupported` for a model it cannot run so,
    here or while the arrays are produced."""
    modules = dict(model.named_modules())
    chosen = [p for p in plans if compensable(p, modules)]
    if not chosen:
        return Collection({}, {}, 0, iter(()))
    try:
        prefix, layers = decoder_layers(model)
    except ConfigError as e:
        raise _unsupported(model, str(e)) from None
    if getattr(model, "voodoo_reader", None) is not None:
        w = _Read(model, prefix, layers, torch.device("cpu") if device is None else torch.device(device))
    else:
        w = _InPlace(model)
    dev, host = w.device, torch.device("cpu")
    read_by = {p.name: reader(p, modules) for p in chosen}
    width = {p.name: modules[read_by[p.name]].in_features for p in chosen}
    with evaluating(model), w.held(), w.outside(), w.probe():
        owner = shared_inputs(model, chosen, modules, tokens[:1, :8].to(dev))
    sizes, shared, order = stored_layout(chosen, owner, width)
    layer_of = {src: _layer_index(read_by[src], prefix) for src in set(owner.values())}

    def arrays() -> Iterator[tuple[str, np.ndarray]]:
        with evaluating(model), w.held():
            batches = [tokens[i:i + batch_size] for i in range(0, tokens.shape[0], batch_size)]
            with w.outside():
                hidden, calls = record(model, layers, batches, dev, _unsupported)
            steps: Sequence[int] = range(len(layers))
            if progress:
                from rich.progress import track

                steps = track(steps, description="Hessians, layer by layer", transient=True)
            for i in steps:
                acc: dict[str, torch.Tensor] = {}
                hooks = [modules[read_by[s]].register_forward_hook(accumulating_hook(acc, s))
                         for s in layer_of if layer_of[s] == i]
                try:
                    with w.layer(i), torch.no_grad():
                        for b in range(len(hidden)):
                            a, k = calls[b][i]
                            y = layers[i](hidden[b].to(dev), *a, **k)
                            if not isinstance(y, torch.Tensor):
                                raise _unsupported(model, f"its decoder layer {i} returns {type(y).__name__}, "
                                                          "not the hidden states")
                            hidden[b] = y.to(host)
                finally:
                    for h in hooks:
                        h.remove()
                yield from _emit(order, acc, width, {s for s in layer_of if layer_of[s] == i})
                del acc
            # the head: what reads the last hidden states, taken as it enters
            after = [s for s in layer_of if layer_of[s] is None]
            if not after:
                return
            acc = {}
            seen: set[str] = set()

            def take(src: str):
                add = accumulating_hook(acc, src)

                def hook(mod, inp):
                    add(mod, inp)
                    seen.add(src)
                    if seen.issuperset(after):
                        raise _HeadReached
                return hook

            hooks = [modules[read_by[s]].register_forward_pre_hook(take(s)) for s in after]
            try:
                with w.outside(), torch.no_grad(), _layers_replaced(layers, None):
                    for b in range(len(hidden)):
                        seen.clear()
                        try:
                            model(inputs_embeds=hidden[b].to(dev), use_cache=False)
                        except _HeadReached:
                            pass
                        hidden[b] = None
            finally:
                for h in hooks:
                    h.remove()
            yield from _emit(order, acc, width, set(after))

    return Collection(sizes, shared, 1, arrays())


def _emit(order, acc: dict[str, torch.Tensor], width: dict[str, int], sources: set[str]):
    for name, src, cols in order:
        if src not in sources:
            continue
        if src in acc:
            h = finished(acc[src])
        else:  # never reached on this text (an unused expert): no column live, the plain bytes
            h = np.zeros((width[src], width[src]), dtype=np.float32)
        yield name, in_gguf_order(h, cols)


@contextlib.contextmanager
def _zero_layers(model: nn.Module, layers: nn.ModuleList, prefix: str, originals, device) -> Iterator[None]:
    """While active, each decoder layer holds float32 zeros of its weights' shapes while it runs
    (no read: a probe of which tensor each Linear reads, not of values)."""
    outside_buffers_to(model, prefix, device)

    def pre(i: int):
        def hook(mod, args, kwargs=None):
            names = _params(layers[i], f"{prefix}.{i}")
            for _name, m, k in names:
                old = m._parameters[k]
                m._parameters[k] = nn.Parameter(torch.zeros(old.shape, dtype=torch.float32, device=device),
                                                requires_grad=False)
            _buffers_to(layers[i], device)
        return hook

    def post(i: int):
        def hook(mod, args, out):
            _release(_params(layers[i], f"{prefix}.{i}"), originals)
        return hook

    handles = []
    try:
        for i, layer in enumerate(layers):
            handles.append(layer.register_forward_pre_hook(pre(i)))
            handles.append(layer.register_forward_hook(post(i)))
        yield
    finally:
        for h in handles:
            h.remove()


def phase_bytes(cfg, model: nn.Module, plans: Sequence, *, loaded: bool = False) -> tuple[float, float, str]:
    """(host bytes, bytes where the layers run, note) of the layer-by-layer collection's peak, from
    shapes: the stored hidden states of ``--compensation_sequences`` × ``--seq_len`` tokens
    (float32) and one batch's output on the host; where the layers run, the largest layer's n²
    float32 accumulators (a tensor reading an input another one reads counted apart: an upper
    bound) and one batch's activations through a layer (its input, q/k/v, and the MLP's three
    intermediate-wide products, float32), plus, from a skeleton, one float32 decoder layer or the
    embedding and head, whichever is larger (a `loaded` model's layers run in place: none)."""
    prefix, layers = decoder_layers(model)
    text = model.config.get_text_config()
    hidden = text.hidden_size
    modules = dict(model.named_modules())
    seqs, T = cfg.compensation_sequences, cfg.seq_len
    batch = min(BATCH, seqs)
    stored = (seqs + batch) * T * hidden * 4.0
    inter = getattr(text, "intermediate_size", 4 * hidden) or 4 * hidden
    act = batch * T * (4 * hidden + 3 * inter) * 4.0
    per_layer: dict[int | None, int] = {}
    for p in plans:
        if compensable(p, modules):
            i = _layer_index(reader(p, modules), prefix)
            per_layer[i] = per_layer.get(i, 0) + p.layout.n_per_row ** 2 * 4
    seen: set[int] = set()
    layer_numel: dict[int | None, int] = {}
    for name, t in model.named_parameters(remove_duplicate=False):
        if id(t) in seen:
            continue
        seen.add(id(t))
        i = _layer_index(name, prefix)
        layer_numel[i] = layer_numel.get(i, 0) + t.numel()
    weights = 0.0 if loaded else max(layer_numel.values()) * 4.0
    acc = float(max(per_layer.values(), default=0))
    layer = "the loaded model's layers in place" if loaded else f"one float32 layer {weights / GB:.2f} GB"
    note = (f"layer by layer: stored hidden states {stored / GB:.2f} GB ({seqs} x {T} tokens), {layer} "
            f"+ one layer's accumulators {acc / GB:.2f} GB + a batch's activations {act / GB:.2f} GB")
    return stored, weights + acc + act, note
