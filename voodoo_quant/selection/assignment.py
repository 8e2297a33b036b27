"""The assignment: which ggml type every selectable tensor gets. Shared by train, export, eval.

One dataclass, saved as JSON (``assignment.json``) and reloaded losslessly; it also renders the
``--tensor-type-file`` that stock ``llama-quantize`` accepts.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from ..core import fileio
from ..core import qtypes as qt
from ..core.errors import CorruptFileError

FORMAT_VERSION = 2
# Format 1 had no provenance (base weights, libggml, menus): still read, refused by export unless
# --allow_mismatch (voodoo_quant/training/provenance.py).
READABLE_VERSIONS = (1, 2)


@dataclass(frozen=True)
class TensorChoice:
    name: str  # HF parameter name, e.g. "model.layers.0.mlp.down_proj.weight"
    qtype: str  # ggml type name from the type table (after fallback)
    shape: tuple[int, ...]  # HF shape (out_features, in_features)
    nbytes: int  # exact bytes in the GGUF
    gguf_name: str | None = None  # llama.cpp tensor name, e.g. "blk.0.ffn_down.weight"
    confidence: float | None = None  # gate probability of the chosen candidate
    menu: tuple[str, ...] = ()  # the tensor's menu, cheapest first
    sha256: str | None = None  # of the chosen candidate's bytes as training read them; export writes no other
    # whether those bytes are error-compensated (W' quantized): False for a plain type under a
    # compensated run (a guarantee reference's off-menu type is stock llama-quantize's bytes);
    # None: not recorded (older files), the assignment's `compensation` says for every tensor
    compensated: bool | None = None

    def __post_init__(self) -> None:
        qt.get(self.qtype)  # refuses unknown names


@dataclass
class Assignment:
    tensors: dict[str, TensorChoice]
    model: str = ""  # identity of the model (path / hub id) it was made for
    imatrix: str | None = None  # path of the imatrix used for every candidate
    imatrix_sha256: str | None = None
    target_bytes: int | None = None  # size the trainer targeted for the selectable tensors
    meta: dict[str, Any] = field(default_factory=dict)
    # provenance (voodoo_quant/training/provenance.py): what the candidates were quantized from and by
    weights_sha256: str | None = None
    ggml_version: str | None = None
    menus: dict[str, list[str]] | None = None  # requested candidate types per role
    base_checkpoint: str | None = None  # the --base_checkpoint whose weights replaced the model's
    # quantizable tensors no candidate covers, written as llama-quantize's base type (budget.py):
    # {GGUF name: [type, bytes]}; None = not recorded (hand-made assignments)
    fixed: dict[str, list] | None = None
    # --error_compensation (compensate.py): {"method", "damp", "hessians" (path), "sha256", "tensors"};
    # None = every candidate quantized the weights as they are
    compensation: dict[str, Any] | None = None
    format_version: int = FORMAT_VERSION  # of the file it was read from

    PROVENANCE = ("weights_sha256", "ggml_version", "menus")

    def missing_provenance(self) -> list[str]:
        """The provenance fields this assignment lacks (all of them for a format-1 file)."""
        return [k for k in self.PROVENANCE if getattr(self, k) in (None, "", {})]

    @property
    def total_bytes(self) -> int:
        return sum(t.nbytes for t in self.tensors.values())

    @property
    def n_weights(self) -> int:
        n = 0
        for t in self.tensors.values():
            k = 1
            for d in t.shape:
                k *= d
            n += k
        return n

    @property
    def bpw(self) -> float:
        return 8.0 * self.total_bytes / max(1, self.n_weights)

    def type_counts(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for t in self.tensors.values():
            out[t.qtype] = out.get(t.qtype, 0) + 1
        return dict(sorted(out.items(), key=lambda kv: -qt.get(kv[0]).bpw))

    # -- serialization -----------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return {
            "format_version": FORMAT_VERSION,
            "model": self.model,
            "imatrix": self.imatrix,
            "imatrix_sha256": self.imatrix_sha256,
            "target_bytes": self.target_bytes,
            "weights_sha256": self.weights_sha256,
            "ggml_version": self.ggml_version,
            "menus": self.menus,
            "base_checkpoint": self.base_checkpoint,
            "fixed": self.fixed,
            "compensation": self.compensation,
            "total_bytes": self.total_bytes,
            "bpw": round(self.bpw, 4),
            "meta": self.meta,
            "tensors": {k: {**asdict(v), "shape": list(v.shape), "menu": list(v.menu)} for k, v in self.tensors.items()},
        }

    @classmethod
    def from_dict(cls, d: dict[str, Any], *, source: str = "assignment") -> "Assignment":
        try:
            if d.get("format_version") not in READABLE_VERSIONS:
                raise CorruptFileError(f"{source}: unsupported format_version {d.get('format_version')!r}")
            tensors = {
                k: TensorChoice(**{**v, "shape": tuple(v["shape"]), "menu": tuple(v.get("menu", ()))})
                for k, v in d["tensors"].items()
            }
            return cls(
                tensors=tensors,
                model=d.get("model", ""),
                imatrix=d.get("imatrix"),
                imatrix_sha256=d.get("imatrix_sha256"),
                target_bytes=d.get("target_bytes"),
                meta=d.get("meta", {}),
                weights_sha256=d.get("weights_sha256"),
                ggml_version=d.get("ggml_version"),
                menus=d.get("menus"),
                base_checkpoint=d.get("base_checkpoint"),
                fixed=d.get("fixed"),
                compensation=d.get("compensation"),
                format_version=int(d["format_version"]),
            )
        except CorruptFileError:
            raise
        except (KeyError, TypeError, AttributeError) as e:
            raise CorruptFileError(f"{source}: malformed assignment ({type(e).__name__}: {e})") from None
        except Exception as e:  # unknown quant type, etc.
            raise CorruptFileError(f"{source}: {e}") from None

    def save(self, path: str | Path) -> Path:
        return fileio.write_json(path, self.to_dict())

    @classmethod
    def load(cls, path: str | Path) -> "Assignment":
        return cls.from_dict(fileio.read_json(path, what="assignment"), source=str(path))

    # -- llama-quantize interop --------------------------------------------------------------
    def tensor_type_lines(self) -> list[str]:
        """Lines for ``llama-quantize --tensor-type-file``.

        llama-quantize matches each pattern with ``std::regex_search`` and the first match wins
        (src/llama-quant.cpp), so names are escaped and anchored to hit exactly one tensor.
        """
        lines = []
        for t in self.tensors.values():
            if not t.gguf_name:
                raise CorruptFileError(f"tensor {t.name} has no GGUF name; cannot write a tensor-type file")
            lines.append(f"^{re.escape(t.gguf_name)}$={t.qtype.lower()}")
        return lines

    def save_tensor_types(self, path: str | Path) -> Path:
        return fileio.write_text(path, "\n".join(self.tensor_type_lines()) + "\n")
