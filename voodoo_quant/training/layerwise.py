"""The Fisher pass one decoder layer at a time, on a skeleton or on a loaded model.

The whole-model pass (``fisher.fisher_diagonal``) runs the model per sequence with hooks and
holds a float32 Fisher accumulator per weight of the whole model (for a 27B model about 108 GB,
beside the model). This pass computes the same curvature matrices while holding one decoder
layer's accumulators (and the embedding's and head's), on either kind of model, with one loop:

- a **skeleton** (``--lazy``, tensor parallelism: parameters on ``meta``, read by name through
  its ``WeightReader``) has each layer read (float32, onto `device`) while it runs and put back
  on ``meta`` after (:class:`Read`);
- a **loaded** model is run in place, where its parameters are, in their dtype: nothing is read,
  moved or replaced (:class:`InPlace`), and nothing is left changed on it.

1. **Record.** The embedding's output for every calibration sequence, and every layer's call
   arguments (masks, rotary embeddings), captured by running the model with its layers replaced
   by recorders that pass the hidden states through.
2. **Forward.** Layer by layer: run on every sequence without a graph, its input kept on the
   host.
3. **Head.** The model's own code after the layers (final norm, LM head) on the last hidden
   states, with grad; labels drawn from its distribution with the same generator, in the same
   order, as the whole-model pass; the gradient at the last hidden states kept.
4. **Backward.** From the top, layer by layer: run again on its stored inputs with a graph, and
   the gradient carried through it. Its tensors' Fisher diagonals are then complete: their
   curvature matrices are computed from the candidates and the diagonals dropped. The
   embedding's own use is added last, as the whole-model pass adds it.

Every module runs in eval mode (each put back as found). Every product and every sum is the
whole-model pass's, in its order, so on the CPU the tables are equal to the bit, from a skeleton
or a loaded model (tests/test_layerwise.py). A model whose code the road cannot follow (its
embeddings changed before the first layer, as Granite scales them; no ModuleList of decoder
layers) raises :class:`LayerwiseUnsupported`; :func:`fisher_curvature` then runs a loaded model
whole. Peak memory: where the layers run, the embedding's and head's accumulators, one layer's
(with, from a skeleton, its float32 weights), one sequence's activations through one layer and
the head's logits of one sequence; on the host, each layer's input for the calibration
sequences, ``(layers + 1) × sequences × seq_len × hidden`` float32 values (:func:`host_bytes`).
"""

from __future__ import annotations

import contextlib
import inspect
import logging
from typing import Callable, Iterator, Mapping, Sequence

import torch
import torch.nn as nn
import torch.nn.functional as F

from ..core.errors import ConfigError
from ..distributed.parallel import decoder_layers
from .fisher import FisherHooks, curvature, curvature_table, fisher_diagonal, module_uses, sample_labels

log = logging.getLogger(__name__)


class LayerwiseUnsupported(ConfigError):
    """A model the layer-by-layer road cannot run (the whole-model pass still can, when the model
    is loaded); `why` says what it lacks."""

    def __init__(self, message: str, why: str):
        super().__init__(message)
        self.why = why


def applies(model: nn.Module) -> bool:
    """Whether `model` is a skeleton with a weight reader (read layer by layer, not run in place)."""
    return getattr(model, "voodoo_reader", None) is not None


def host_bytes(n_layers: int, sequences: int, seq_len: int, hidden: int) -> int:
    """Host bytes of the stored layer inputs (float32), the pass's largest term."""
    return (n_layers + 1) * sequences * seq_len * hidden * 4


def accumulator_bytes(model: nn.Module, plans: Sequence) -> tuple[int, int]:
    """(float32 bytes of the Fisher accumulators held the whole pass: the tensors used outside the
    decoder layers, as the embedding and head; the largest decoder layer's), from shapes."""
    prefix, _layers = decoder_layers(model)
    per: dict[int | None, int] = {}
    for p in plans:
        idx = {_layer_index(m, prefix) for m in p.modules}
        i = idx.pop() if len(idx) == 1 else None
        n = 1
        for d in p.shape:
            n *= int(d)
        per[i] = per.get(i, 0) + n * 4
    outside = per.pop(None, 0)
    return outside, max(per.values(), default=0)


class _Pass(nn.Module):
    """Stands in for decoder layer `index`: records its call's arguments into `sink` (when given)
    and returns the hidden states unchanged."""

    def __init__(self, index: int, sink: dict | None = None):
        super().__init__()
        self.index, self.sink = index, sink

    def forward(self, hidden_states, *args, **kwargs):
        if self.sink is not None:
            self.sink[self.index] = (hidden_states, args, kwargs)
        return hidden_states


@contextlib.contextmanager
def _layers_replaced(layers: nn.ModuleList, sink: dict | None) -> Iterator[None]:
    real = list(layers)
    try:
        for i in range(len(real)):
            layers[i] = _Pass(i, sink)
        yield
    finally:
        for i, m in enumerate(real):
            layers[i] = m


@contextlib.contextmanager
def _restored(model: nn.Module) -> Iterator[None]:
    """Every module's parameters and buffers put back as they were (meta skeleton tensors) on exit."""
    saved = [(m, dict(m._parameters), dict(m._buffers)) for m in model.modules()]
    try:
        yield
    finally:
        for m, params, bufs in saved:
            m._parameters.clear()
            m._parameters.update(params)
            m._buffers.clear()
            m._buffers.update(bufs)


def _materialize(model: nn.Module, names: Sequence[tuple[str, nn.Module, str]], reader, device) -> None:
    """Read (float32, onto `device`) each ``(qualified name, module, attribute)``, once per tied
    tensor, and put it on every module that holds the same skeleton parameter."""
    holders: dict[int, list[tuple[nn.Module, str]]] = {}
    for m in model.modules():
        for k, p in m._parameters.items():
            if p is not None:
                holders.setdefault(id(p), []).append((m, k))
    for name, mod, attr in names:
        old = mod._parameters[attr]
        if id(old) not in holders:  # a tied tensor's second name: already read under its first
            continue
        t = reader.get(name, tuple(old.shape)).to(device=device, dtype=torch.float32)
        new = nn.Parameter(t, requires_grad=False)
        for m, k in holders.pop(id(old)):
            m._parameters[k] = new


def _buffers_to(mod: nn.Module, device, recurse: bool = True) -> None:
    for m in (mod.modules() if recurse else (mod,)):
        for k, b in list(m._buffers.items()):
            if b is not None and b.device.type != "meta":
                m._buffers[k] = b.to(device)


def _params(mod: nn.Module, prefix: str) -> list[tuple[str, nn.Module, str]]:
    out = []
    for mname, m in mod.named_modules(prefix=prefix):
        for k, p in m._parameters.items():
            if p is not None:
                out.append((f"{mname}.{k}" if mname else k, m, k))
    return out


def _release(names: Sequence[tuple[str, nn.Module, str]], originals: Mapping[tuple[int, str], nn.Parameter]) -> None:
    for _name, mod, attr in names:
        mod._parameters[attr] = originals[(id(mod), attr)]


def _accepts(fn, name: str) -> bool:
    try:
        return name in inspect.signature(fn).parameters
    except (TypeError, ValueError):  # pragma: no cover - a builtin without a signature
        return False


def record(model: nn.Module, layers: nn.ModuleList, batches: Sequence[torch.Tensor], device,
           unsupported: Callable[[nn.Module, str], Exception]) -> tuple[list[torch.Tensor], list[list[tuple]]]:
    """(each batch's embedding output, on the host; each batch's call arguments of every decoder
    layer): the model run on each batch of token ids with its layers replaced by recorders that
    pass the hidden states through (its embedding, norms and head must be materialized). A model
    whose code changes the embeddings before the first layer is refused with `unsupported`."""
    keep = {"logits_to_keep": 1} if _accepts(model.forward, "logits_to_keep") else {}
    emb = model.get_input_embeddings()
    n_layers = len(layers)
    hidden, calls = [], []
    for batch in batches:
        ids = batch.to(device)
        sink: dict[int, tuple] = {}
        with torch.no_grad(), _layers_replaced(layers, sink):
            x0 = emb(ids)
            model(inputs_embeds=x0, use_cache=False, **keep)
        if len(sink) != n_layers or not torch.equal(sink[0][0], x0):
            raise unsupported(model, "it does not feed its embeddings to the first decoder layer unchanged")
        hidden.append(x0.to(torch.device("cpu")))
        calls.append([(a, k) for _h, a, k in (sink[i] for i in range(n_layers))])
    return hidden, calls


class Read:
    """A skeleton's weights: the embedding, norms and head, or one decoder layer, read from the
    checkpoint (float32, onto `device`) while in use, and put back on ``meta`` after."""

    def __init__(self, model: nn.Module, prefix: str, layers: nn.ModuleList, device: torch.device):
        self.model, self.prefix, self.layers, self.device = model, prefix, layers, device
        self.reader = model.voodoo_reader
        self.originals: dict = {}

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """The pass's span: every parameter and buffer put back as found on exit."""
        with _restored(self.model):
            self.originals = {(id(m), k): p for m in self.model.modules() for k, p in m._parameters.items()}
            yield

    @contextlib.contextmanager
    def outside(self) -> Iterator[None]:
        names = outside_params(self.model, self.prefix)
        _materialize(self.model, names, self.reader, self.device)
        outside_buffers_to(self.model, self.prefix, self.device)
        try:
            yield
        finally:
            _release(names, self.originals)

    @contextlib.contextmanager
    def layer(self, i: int) -> Iterator[None]:
        names = _params(self.layers[i], f"{self.prefix}.{i}")
        _materialize(self.model, names, self.reader, self.device)
        _buffers_to(self.layers[i], self.device)
        try:
            yield
        finally:
            _release(names, self.originals)


class InPlace:
    """A loaded model's own weights, where they are and in their dtype: nothing to read, move or
    release."""

    def __init__(self, model: nn.Module):
        self.device = next(model.parameters()).device

    def held(self):
        return contextlib.nullcontext()

    def outside(self):
        return contextlib.nullcontext()

    def layer(self, i: int):
        return contextlib.nullcontext()


def weights_of(model: nn.Module, prefix: str, layers: nn.ModuleList, device: torch.device | None):
    """:class:`Read` for a skeleton (onto `device`, default the CPU), :class:`InPlace` for a loaded
    model (its own device; `device` is not used)."""
    if applies(model):
        return Read(model, prefix, layers, torch.device("cpu") if device is None else torch.device(device))
    return InPlace(model)


@contextlib.contextmanager
def evaluating(model: nn.Module) -> Iterator[None]:
    """Every module in eval mode (a layer run twice must compute the same thing twice), each put
    back as found."""
    modes = [(m, m.training) for m in model.modules()]
    model.eval()
    try:
        yield
    finally:
        for m, was in modes:
            m.training = was


def outside_params(model: nn.Module, prefix: str):
    return [t for t in _params(model, "") if not t[0].startswith(prefix + ".")]


def outside_buffers_to(model: nn.Module, prefix: str, device) -> None:
    for mname, m in model.named_modules():
        if not mname.startswith(prefix + ".") and mname != prefix:
            _buffers_to(m, device, recurse=False)


def fisher_curvature(model: nn.Module, plans: Sequence, tokens: torch.Tensor,
                     blobs_for: Callable[[object], Mapping[str, bytes]], weights: Mapping[str, torch.Tensor], *,
                     seed: int = 0, device: torch.device | None = None
                     ) -> tuple[dict[str, dict], dict[str, torch.Tensor] | None]:
    """(the curvature table, None) layer by layer (:func:`layerwise_curvature`); for a loaded
    model the road refuses, (the table, the Fisher diagonals) of the whole-model pass, with a log
    line saying why. `weights` are the planned tensors' float weights (the whole-model pass's)."""
    try:
        return layerwise_curvature(model, plans, tokens, blobs_for, seed=seed, device=device), None
    except LayerwiseUnsupported as e:
        if applies(model):
            raise
        log.info("sensitivity pass: not layer by layer (%s): the whole model instead, "
                 "a float32 Fisher accumulator per weight", e.why)
    fish = fisher_diagonal(model, plans, tokens, seed=seed)
    return curvature_table(plans, weights, fish, blobs_for), fish


def layerwise_curvature(model: nn.Module, plans: Sequence, tokens: torch.Tensor,
                        blobs_for: Callable[[object], Mapping[str, bytes]], *, seed: int = 0,
                        device: torch.device | None = None) -> dict[str, dict]:
    """tensor -> {"types", "m"} as ``fisher.curvature_table(plans, weights, fisher_diagonal(...))``
    of the loaded model would give, computed one decoder layer at a time (module docstring).
    `blobs_for(plan)` gives type -> ggml bytes of the rungs to price. `model` is a skeleton (read
    onto `device`, default the CPU; left as it was found, every parameter back on ``meta``) or a
    loaded model (run in place on its own device, left as it was found). Raises
    :class:`LayerwiseUnsupported` for a model it cannot run so."""
    try:
        prefix, layers = decoder_layers(model)
    except ConfigError as e:
        raise _unsupported(model, str(e)) from None
    w = weights_of(model, prefix, layers, device)
    device, host = w.device, torch.device("cpu")
    n_layers = len(layers)
    modules = dict(model.named_modules())
    use = module_uses(plans)
    layer_of: dict[str, int | None] = {}
    for p in plans:
        idx = {_layer_index(m, prefix) for m in p.modules}
        layer_of[p.name] = idx.pop() if len(idx) == 1 else None
        if layer_of[p.name] is None and _layer_index(p.modules[0], prefix) is not None:
            raise _unsupported(model, f"{p.name} is used inside and outside its decoder layers")
    by_layer: dict[int | None, list] = {}
    for p in plans:
        by_layer.setdefault(layer_of[p.name], []).append(p)
    emb = model.get_input_embeddings()
    emb_name = next((m for m, mod in modules.items() if mod is emb), None)
    fisher: dict[str, torch.Tensor] = {}
    acc = FisherHooks(modules, use, fisher)
    out: dict[str, dict] = {}

    def weight_of(p) -> torch.Tensor:
        return modules[p.modules[0]].weight

    def start(ps) -> None:
        for p in ps:
            fisher[p.name] = torch.zeros(weight_of(p).shape, dtype=torch.float32, device=device)

    def finish(ps, n_tok: int) -> None:
        for p in ps:
            f = fisher.pop(p.name).div_(max(1, n_tok))
            types, m = curvature(p, weight_of(p), f, blobs_for(p))
            out[p.name] = {"types": types, "m": m.tolist()}

    with evaluating(model), w.held(), w.outside():
        start(by_layer.get(None, []))

        # 1. record: every sequence's embedding output and every layer's call arguments
        ids_of = [row.to(device) for row in tokens]
        x0s, calls = record(model, layers, [row.unsqueeze(0) for row in tokens], device, _unsupported)
        hidden = [[x0] for x0 in x0s]

        # 2. forward, one layer at a time; each layer's input stays on the host
        for i in range(n_layers):
            with w.layer(i), torch.no_grad():
                for s in range(len(hidden)):
                    a, k = calls[s][i]
                    y = layers[i](hidden[s][i].to(device), *a, **k)
                    if not isinstance(y, torch.Tensor):
                        raise _unsupported(model, f"its decoder layer {i} returns {type(y).__name__}, not the hidden states")
                    hidden[s].append(y.to(host))
        log.info("sensitivity pass: %d layers forward, %d sequences", n_layers, len(hidden))

        # 3. the head: the model's code after the layers, labels drawn as the whole-model pass draws them
        gen = torch.Generator().manual_seed(seed)
        grads, n_tok = [], 0
        outside_modules = [m for m in use if layer_of[use[m]] is None]
        with _layers_replaced(layers, None), acc.linears(outside_modules):
            for s in range(len(hidden)):
                x = hidden[s][n_layers].to(device).requires_grad_(True)
                logits = model(inputs_embeds=x, use_cache=False).logits[0, :-1].float()
                y = sample_labels(logits, gen)
                loss = F.cross_entropy(logits, y, reduction="sum")
                (g,) = torch.autograd.grad(loss, x)
                del logits, loss
                grads.append(g)
                n_tok += y.shape[0]
                hidden[s].pop()

        # 4. backward, one layer at a time from the top; a layer's curvature as soon as it is complete
        for i in reversed(range(n_layers)):
            with w.layer(i):
                ps = by_layer.get(i, [])
                start(ps)
                with acc.linears([m for m in use if _layer_index(m, prefix) == i]):
                    for s in range(len(hidden)):
                        a, k = calls[s][i]
                        x = hidden[s].pop().to(device).requires_grad_(True)
                        y = layers[i](x, *a, **k)
                        (grads[s],) = torch.autograd.grad(y, x, grad_outputs=grads[s])
                finish(ps, n_tok)
        if emb_name in use:  # the embedding's own use, after every LM-head term (fisher_diagonal's order)
            for ids, g in zip(ids_of, grads):
                acc.embedding(emb_name, ids, g[0])
        finish(by_layer.get(None, []), n_tok)
    return out


def _unsupported(model: nn.Module, why: str) -> LayerwiseUnsupported:
    return LayerwiseUnsupported(f"the layer-by-layer sensitivity pass cannot run on {type(model).__name__}: {why}; "
                                "--sensitivity_kind output computes the table on the whole model instead", why)


def _layer_index(mname: str, prefix: str) -> int | None:
    head = prefix + "."
    if not mname.startswith(head):
        return None
    first = mname[len(head):].split(".", 1)[0]
    return int(first) if first.isdigit() else None
