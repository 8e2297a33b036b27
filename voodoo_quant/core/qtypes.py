"""The one table of ggml quantization types.

Everything else (CLI choices, size accounting, menus, fallbacks, the export badge, the doctor)
derives from :data:`QTYPES`. Block sizes and bytes per block are those of ggml at the pinned
commit (``ggml/src/ggml.c`` ``type_traits``); a test checks every row against the C library.
"""

from __future__ import annotations

from dataclasses import dataclass

from .errors import QuantizationInputError, UnknownQuantTypeError


@dataclass(frozen=True)
class QType:
    name: str
    id: int  # enum ggml_type
    block: int  # weights per block (ggml blck_size)
    type_size: int  # bytes per block
    # ggml_quantize_requires_imatrix(): a NULL imatrix aborts the process.
    ggml_needs_imatrix: bool = False
    # llama-quantize refuses these without an imatrix (src/llama-quant.cpp tensor_requires_imatrix);
    # we follow it, since a runtime user would never get such a file from the stock tool.
    needs_imatrix: bool = False
    # llama-quantize's type for rows that are not a multiple of `block`
    # (src/llama-quant.cpp tensor_type_fallback); None = the type itself (32-block types, floats).
    fallback: str | None = None
    is_float: bool = False

    @property
    def bpw(self) -> float:
        """Bits per weight."""
        return self.type_size * 8.0 / self.block

    def row_bytes(self, n_per_row: int) -> int:
        """Bytes of one row (ggml_row_size), refusing row lengths the type cannot hold."""
        if n_per_row % self.block:
            raise QuantizationInputError(
                f"row size ({n_per_row}) is not a multiple of {self.name} block size ({self.block})"
            )
        return n_per_row // self.block * self.type_size

    def fits(self, n_per_row: int) -> bool:
        return n_per_row % self.block == 0


def _t(name, id, block, size, **kw) -> QType:
    return QType(name, id, block, size, **kw)


_IQ = dict(fallback="IQ4_NL")
QTYPES: dict[str, QType] = {
    q.name: q
    for q in (
        _t("F32", 0, 1, 4, is_float=True),
        _t("F16", 1, 1, 2, is_float=True),
        _t("BF16", 30, 1, 2, is_float=True),
        _t("Q8_0", 8, 32, 34),
        _t("Q6_K", 14, 256, 210, fallback="Q8_0"),
        _t("Q5_1", 7, 32, 24),
        _t("Q5_K", 13, 256, 176, fallback="Q5_1"),
        _t("Q5_0", 6, 32, 22),
        _t("Q4_1", 3, 32, 20),
        _t("Q4_K", 12, 256, 144, fallback="Q5_0"),
        _t("IQ4_NL", 20, 32, 18),
        _t("Q4_0", 2, 32, 18),
        _t("IQ4_XS", 23, 256, 136, **_IQ),
        _t("MXFP4", 39, 32, 17),
        _t("Q3_K", 11, 256, 110, fallback="Q4_0"),
        _t("IQ3_S", 21, 256, 110, **_IQ),
        _t("IQ3_XXS", 18, 256, 98, needs_imatrix=True, **_IQ),
        _t("Q2_K", 10, 256, 84, fallback="Q4_0"),
        _t("IQ2_S", 22, 256, 82, needs_imatrix=True, **_IQ),
        _t("IQ2_XS", 17, 256, 74, ggml_needs_imatrix=True, needs_imatrix=True, **_IQ),
        _t("IQ2_XXS", 16, 256, 66, ggml_needs_imatrix=True, needs_imatrix=True, **_IQ),
        _t("TQ2_0", 35, 256, 66, fallback="Q4_0"),
        _t("IQ1_M", 29, 256, 56, needs_imatrix=True, **_IQ),
        _t("TQ1_0", 34, 256, 54, fallback="Q4_0"),
        _t("IQ1_S", 19, 256, 50, ggml_needs_imatrix=True, needs_imatrix=True, **_IQ),
    )
}
BY_ID: dict[int, QType] = {q.id: q for q in QTYPES.values()}

# Types that may appear on a candidate menu: the quantized ones llama.cpp serves, plus F16/BF16.
MENU_TYPES: tuple[str, ...] = tuple(n for n in QTYPES if n != "F32")


def get(name: str | QType) -> QType:
    """Look a type up by name (case-insensitive); the error lists the known names."""
    if isinstance(name, QType):
        return name
    q = QTYPES.get(str(name).upper())
    if q is None:
        raise UnknownQuantTypeError(
            f"unknown quantization type {name!r}; known: {', '.join(QTYPES)}"
        )
    return q


def by_id(type_id: int) -> QType:
    try:
        return BY_ID[int(type_id)]
    except KeyError:
        raise UnknownQuantTypeError(f"ggml type id {type_id} is not in the type table") from None


def resolve_for_row(name: str | QType, n_per_row: int) -> QType:
    """The type llama-quantize would actually write for rows of `n_per_row` weights.

    Mirrors ``tensor_type_fallback`` in llama.cpp ``src/llama-quant.cpp``: a 256-block type
    falls back to its 32-block sibling, and when even that does not fit, to F16.
    """
    q = get(name)
    if q.fits(n_per_row):
        return q
    if q.fallback is not None:
        fb = QTYPES[q.fallback]
        if fb.fits(n_per_row):
            return fb
    return QTYPES["F16"]


def tensor_bytes(name: str | QType, shape: tuple[int, ...]) -> int:
    """Exact bytes of a tensor of `shape` (last dim = row length, as in ggml ne[0]) in a type."""
    q = get(name)
    n_per_row = int(shape[-1])
    rows = 1
    for d in shape[:-1]:
        rows *= int(d)
    return rows * q.row_bytes(n_per_row)


# llama.cpp's file-type names (include/llama.h enum llama_ftype), for metadata and badges.
LLAMA_FTYPES: dict[str, int] = {
    "F32": 0, "F16": 1, "Q4_0": 2, "Q4_1": 3, "Q8_0": 7, "Q5_0": 8, "Q5_1": 9, "Q2_K": 10,
    "Q3_K_S": 11, "Q3_K_M": 12, "Q3_K_L": 13, "Q4_K_S": 14, "Q4_K_M": 15, "Q5_K_S": 16,
    "Q5_K_M": 17, "Q6_K": 18, "IQ2_XXS": 19, "IQ2_XS": 20, "Q2_K_S": 21, "IQ3_XS": 22,
    "IQ3_XXS": 23, "IQ1_S": 24, "IQ4_NL": 25, "IQ3_S": 26, "IQ3_M": 27, "IQ2_S": 28, "IQ2_M": 29,
    "IQ4_XS": 30, "IQ1_M": 31, "BF16": 32, "TQ1_0": 36, "TQ2_0": 37, "MXFP4_MOE": 38,
}

# The standard sizes and their curated badges. A badge is the llama.cpp recipe name that users
# and model hubs associate with a size class, so hubs index the file; it is a fixed label, not
# derived from the assignment (the file's real bits per weight go in its metadata).
STANDARD_SIZES: tuple[int, ...] = tuple(range(25, 85, 5))
BADGES: dict[int, str] = {
    25: "IQ1_M", 30: "IQ2_XXS", 35: "IQ2_XS", 40: "IQ2_S", 45: "IQ2_M", 50: "IQ3_XXS",
    55: "IQ3_S", 60: "IQ3_M", 65: "Q3_K_L", 70: "IQ4_XS", 75: "Q4_K_M", 80: "Q5_K_M",
}
assert set(BADGES) == set(STANDARD_SIZES)
assert all(b in LLAMA_FTYPES for b in BADGES.values())


def badge_for(percent: int) -> str:
    if percent not in BADGES:
        raise UnknownQuantTypeError(
            f"Voodoo{percent} is not a standard size; standard: "
            + ", ".join(f"Voodoo{p}" for p in STANDARD_SIZES)
        )
    return BADGES[percent]
