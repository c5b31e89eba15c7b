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


@pytest.fixture(scope="session", params=["fused/avx512-bf16", "fused/torch", "python/torch"])
def tiny_int4_target(request, tiny_tokenizer):
    """The tiny target's weights quantized as the default model ships (Q4_1 linears, Q8_0 LM
    head), in the compact forward; every test taking it runs on each way of running its layers
    with each 4-bit matmul kernel that they use (a way that cannot run here skips, saying why)."""
    from constrained_spec import kernels, llama

    layers, matmul = request.param.split("/")
    if layers == "fused" and (missing := kernels.fused_missing()):
        pytest.skip(f"the fused layers cannot be compiled here: {missing}")
    if missing := kernels.int4_kernel_missing(matmul):
        pytest.skip(f"the {matmul} 4-bit kernel cannot run here: {missing}")
    model = llama.from_transformers(testing.tiny_model(tiny_tokenizer, seed=0), "int4")
    model.use_matmul(matmul)
    model.use_layers(layers)
    return model


@pytest.fixture(params=["llguidance", "regex"])
def engine(request):
    """Both constraint engines: every test taking this fixture runs on each."""
    return request.param
