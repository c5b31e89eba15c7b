"""Fixtures: the tiny tokenizer and models of constrained_spec.testing, built once a session."""

import pytest
import torch

from constrained_spec import testing

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores


@pytest.fixture(scope="session")
def tiny_tokenizer():
    return testing.tiny_tokenizer()


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    return testing.tiny_model(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_tokenizer):
    return testing.tiny_model(tiny_tokenizer, seed=1, layers=1)


def int4_target(tokenizer, way: str):
    """The tiny target's weights quantized as the default model ships (Q4_1 linears, Q8_0 LM
    head), in the compact forward, its layers and 4-bit matmuls run ``way`` ("fused/avx2", ...);
    a way that cannot run here skips, saying why."""
    from constrained_spec.model import kernels, llama

    layers, matmul = way.split("/")
    if layers == "fused" and (missing := kernels.fused_missing()):
        pytest.skip(f"the fused layers cannot run here: {missing}")
    if missing := kernels.int4_kernel_missing(matmul):
        pytest.skip(f"the {matmul} 4-bit kernel cannot run here: {missing}")
    model = llama.from_transformers(testing.tiny_model(tokenizer, seed=0), "int4")
    model.use_matmul(matmul)
    model.use_layers(layers)
    return model


@pytest.fixture(scope="session", params=["fused", "python"])
def tiny_int4_target(request, tiny_tokenizer):
    """The 4-bit tiny target (int4_target); every test taking it runs on the fused layers with
    the 4-bit kernel a CPU like this one picks (ours: AMX where it has amx_bf16, else AVX-512
    where it has avx512_bf16, else AVX2 or NEON dot products on int8 activations, else blocks.h's
    scalar reference) and on the Python loop with torch's kernel (an install without the kernel
    library). The fused layers with the other kernels run in the kernel-level tests
    (tests/test_llama.py, tests/test_compiled.py) and in every_int4_target's."""
    from constrained_spec.model import models

    if request.param == "python":
        return int4_target(tiny_tokenizer, "python/torch")
    return int4_target(tiny_tokenizer, f"fused/{models.matmul_kernel()}")


@pytest.fixture(
    scope="session",
    params=[
        "fused/avx512-bf16",
        "fused/amx-bf16",
        "fused/avx2",
        "fused/neon",
        "python/torch",
    ],
)
def every_int4_target(request, tiny_tokenizer):
    """The 4-bit tiny target on every way of running it (int4_target; torch's 4-bit kernel runs
    the Python layers only: the kernel library cannot call it)."""
    return int4_target(tiny_tokenizer, request.param)
