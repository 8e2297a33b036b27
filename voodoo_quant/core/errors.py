"""Typed errors of the library.

Library code raises these; only the CLI layer turns them into one line and an exit code.
Every message names the thing that is wrong (file, tensor, type, sizes) so the line alone is
enough to act on.
"""


class VoodooError(Exception):
    """Base class of every error this package raises on purpose."""

    exit_code = 1


class ConfigError(VoodooError):
    """A flag, a config value or a combination of them is invalid."""

    exit_code = 2


class EnvironmentVarError(ConfigError):
    """A ``VOODOO_*`` environment variable holds a value we cannot use."""


class GGMLLibraryError(VoodooError):
    """libggml-base cannot be found or loaded, or lacks a symbol we need."""


class QuantizationInputError(VoodooError, ValueError):
    """Input that would make the C quantizer misbehave (bad row length, NaN, wrong dtype, ...).

    Raised *before* any call into C: at Release build ggml does not check these and may write
    garbage or abort the whole process.
    """


class UnknownQuantTypeError(ConfigError):
    """A quantization type name that the type table does not know."""


class CorruptFileError(VoodooError):
    """A file exists but its content is not what it must be (truncated, bit-flipped, wrong format)."""


class MissingToolError(VoodooError):
    """A stock llama.cpp tool (llama-quantize, llama-perplexity, ...) is not built."""


class ToolFailedError(VoodooError):
    """A stock llama.cpp tool ran and failed."""


class DeviceError(ConfigError):
    """A ``--device`` that does not exist on this machine (the message lists those that do)."""


class MemoryFitError(VoodooError):
    """A run's memory plan does not fit its device, and no setting that keeps its result makes it
    fit (``--memory_check``): raised before the run loads anything; the message names the need,
    the capacity and the flags that would fit."""
