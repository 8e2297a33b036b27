"""Loading a model one tensor at a time: a skeleton without weights, and a reader of named tensors.

A tensor-parallel rank needs only its shard of every weight, and the candidates of a selectable
tensor need its full matrix only while they are quantized (or found in the cache). So a rank
builds the model's *skeleton* (every parameter on the ``meta`` device, no bytes; buffers such as
rotary ``inv_freq`` computed on the CPU by the model itself, as they are not in checkpoints) and
fills it from a :class:`WeightReader`: full tensors read one at a time, or only the rows / columns
of a shard (safetensors' sliced reads; a ``.pt`` checkpoint is memory-mapped, so a read touches
only the pages it copies).
"""

from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn as nn

from ..core.errors import CorruptFileError
from .checkpoints import TEACHER_FORMAT, entry_to_float
from .modeling import _map_key, load_config, resolve_text_class


@contextlib.contextmanager
def params_on_meta() -> Iterator[None]:
    """While active, every ``nn.Parameter`` registered on a module is moved to ``meta`` (buffers
    stay where their module creates them). Parameter initializers then run on meta tensors: free."""
    old = nn.Module.register_parameter

    def register(self: nn.Module, name: str, param: nn.Parameter | None) -> None:
        old(self, name, param)
        p = self._parameters.get(name)
        if p is not None and p.device.type != "meta":
            self._parameters[name] = nn.Parameter(p.to("meta"), requires_grad=p.requires_grad)

    nn.Module.register_parameter = register  # type: ignore[method-assign]
    try:
        yield
    finally:
        nn.Module.register_parameter = old  # type: ignore[method-assign]


def skeleton(cls, config) -> nn.Module:
    """`cls(config)` with its parameters on ``meta`` (tied ones tied), in eval mode."""
    from transformers.initialization import no_init_weights

    with params_on_meta(), no_init_weights():
        model = cls(config)
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    return model.eval()


def text_skeleton(source: str | os.PathLike, text_model_class: str | None = None) -> nn.Module:
    """The skeleton of the causal LM that :func:`voodoo_quant.model.modeling.load_model` would load."""
    import transformers

    config = load_config(source)
    if text_model_class is None:
        from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES as LM_NAMES

        name = LM_NAMES.get(config.model_type)
        if name is not None:
            return skeleton(getattr(transformers, name), config)
    cls, text_cfg = resolve_text_class(config, text_model_class)
    return skeleton(cls, text_cfg)


def meta_names(model: nn.Module) -> list[str]:
    """Parameter and buffer names still on ``meta`` (tied ones once, by their first name)."""
    seen: set[int] = set()
    out = []
    for name, t in [*model.named_parameters(remove_duplicate=False), *model.named_buffers(remove_duplicate=False)]:
        if t.device.type == "meta" and id(t) not in seen:
            seen.add(id(t))
            out.append(name)
    return out


def set_tensor(model: nn.Module, name: str, value: torch.Tensor) -> None:
    """Replace parameter (or buffer) `name` by `value` on every module that holds the same object."""
    mname, _, pname = name.rpartition(".")
    mod = model.get_submodule(mname) if mname else model
    old = mod._parameters.get(pname) if pname in mod._parameters else mod._buffers.get(pname)
    if old is None and pname not in mod._buffers:
        raise KeyError(f"{name}: no such parameter or buffer")
    if pname in mod._buffers:
        mod._buffers[pname] = value
        return
    new = nn.Parameter(value, requires_grad=False)
    for m in model.modules():
        for k, v in list(m._parameters.items()):
            if v is old:
                m._parameters[k] = new


class WeightReader:
    """Named tensors of a checkpoint, read one at a time: an HF dir's safetensors (keys mapped to
    the text model's names, as ``voodoo make-teacher`` does) and optionally a ``.pt`` state dict
    (a plain one, ``voodoo-base/1`` or ``voodoo-teacher/1``) whose entries take precedence."""

    def __init__(self, model_dir: str | os.PathLike, model: nn.Module, *, strip_prefix: str | None = None,
                 checkpoint: str | os.PathLike | None = None):
        expected = {n for n, _ in [*model.named_parameters(remove_duplicate=False),
                                   *model.named_buffers(remove_duplicate=False)]}
        self._where: dict[str, tuple[Path, str]] = {}
        for f in sorted(Path(model_dir).glob("*.safetensors")):
            from safetensors import safe_open

            with safe_open(str(f), framework="pt") as st:
                for key in st.keys():
                    name = _map_key(key, expected, strip_prefix)
                    if name is None and strip_prefix is None:
                        name = _map_key(key, expected, "model.language_model.")
                    if name is not None:
                        self._where.setdefault(name, (f, key))
        # tied names (an LM head sharing the embedding) read the one stored tensor
        groups: dict[int, list[str]] = {}
        for n, t in model.named_parameters(remove_duplicate=False):
            groups.setdefault(id(t), []).append(n)
        self._alias = {n: names for names in groups.values() for n in names if len(names) > 1}
        self._ckpt: dict[str, Any] = {}
        self._teacher = False
        if checkpoint:
            self._load_checkpoint(Path(checkpoint))

    def _load_checkpoint(self, path: Path) -> None:
        if not path.is_file():
            raise CorruptFileError(f"checkpoint {path} does not exist")
        try:  # memory-mapped: an entry's pages are read when it is used, not now
            obj = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
        except Exception as e:  # noqa: BLE001 - the file is the cause (see fileio.torch_load)
            raise CorruptFileError(f"checkpoint {path} is corrupt or not a plain weights file: {e}") from None
        if isinstance(obj, dict) and obj.get("format") == TEACHER_FORMAT:
            self._ckpt, self._teacher = dict(obj["tensors"]), True
        elif isinstance(obj, dict):
            sd = obj.get("state_dict", obj)
            self._ckpt = {k: v for k, v in sd.items() if isinstance(v, torch.Tensor)}
        else:
            raise CorruptFileError(f"checkpoint {path} is not a state dict")

    def _stored(self, name: str) -> str:
        for n in (name, *self._alias.get(name, ())):
            if n in self._ckpt or n in self._where:
                return n
        raise CorruptFileError(f"no checkpoint tensor for {name}")

    def __contains__(self, name: str) -> bool:
        try:
            self._stored(name)
        except CorruptFileError:
            return False
        return True

    @property
    def is_teacher(self) -> bool:
        """Whether the checkpoint is a ``voodoo-teacher/1`` (packed Q8_0 entries)."""
        return self._teacher

    def entry(self, name: str) -> dict[str, Any] | None:
        """The raw ``voodoo-teacher/1`` entry of `name` (e.g. packed Q8_0 ``qs`` / ``d``), or None
        when the tensor does not come from a teacher checkpoint."""
        stored = self._stored(name)
        return self._ckpt[stored] if self._teacher and stored in self._ckpt else None

    def get(self, name: str, shape: Sequence[int] | None = None) -> torch.Tensor:
        """The whole tensor `name`, float32 (a teacher entry dequantized exactly)."""
        name = self._stored(name)
        if name in self._ckpt:
            e = self._ckpt[name]
            if self._teacher:
                t = entry_to_float(e)
            else:
                t = e.to(torch.float32)
            return t.reshape(tuple(shape)) if shape is not None else t
        f, key = self._source(name)
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            return st.get_tensor(key).to(torch.float32)

    def get_shard(self, name: str, dim: int, bounds: Sequence[tuple[int, int]],
                  shape: Sequence[int] | None = None) -> torch.Tensor:
        """Only the [lo, hi) ranges of `name` along `dim` (concatenated), float32."""
        name = self._stored(name)
        if name in self._ckpt:
            full = self.get(name, shape)
            return torch.cat([full.narrow(dim, lo, hi - lo) for lo, hi in bounds], dim).contiguous()
        f, key = self._source(name)
        from safetensors import safe_open

        with safe_open(str(f), framework="pt") as st:
            sl = st.get_slice(key)
            parts = []
            for lo, hi in bounds:
                idx = tuple([slice(None)] * dim + [slice(lo, hi)])
                parts.append(sl[idx].to(torch.float32))
        return torch.cat(parts, dim).contiguous()

    def _source(self, name: str) -> tuple[Path, str]:
        return self._where[self._stored(name)]
