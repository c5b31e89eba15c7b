"""The target model: loading (the built-in GGUF, local paths, hub ids), the weights choice, the
compact 4-bit forward (``llama``) with its kernels (``kernels``, ``csrc/``: fixed by the CPU's
features), and every KV-cache operation (``kv``). Nothing here knows a constraint: logits come back for the
decoding layer to mask."""

from .machine import cache_dir
from .models import (
    BUILTIN_MODELS,
    DEFAULT_MODEL,
    WEIGHTS,
    ModelFetchError,
    describe_weights,
    load_model,
    load_tokenizer,
    quantize_int8,
    skinny_matmul,
)

__all__ = [
    "BUILTIN_MODELS",
    "DEFAULT_MODEL",
    "WEIGHTS",
    "ModelFetchError",
    "cache_dir",
    "describe_weights",
    "load_model",
    "load_tokenizer",
    "quantize_int8",
    "skinny_matmul",
]
