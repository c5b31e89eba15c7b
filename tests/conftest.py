"""Tiny models built in the test: a byte-level BPE tokenizer trained here, random Llama weights."""

import pytest
import torch

torch.set_num_threads(1)  # tiny models: threads only add overhead, and CI has 2 cores
import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

SCALE = 8.0  # lm_head gain: distributions peaked enough to be distinct, flat enough to test
CORPUS = ['{"name": "Alice", "age": 30}', '{"name": "Bob", "age": 7, "ok": true}',
          "abba baab abab", "yes no yes no", "[1, 2, 3]", "Zoë 東京 null false"] * 20


@pytest.fixture(scope="session")
def tiny_tokenizer():
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=320, special_tokens=["<eos>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(CORPUS, trainer)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<eos>")


def tiny_model(tokenizer, seed: int, layers: int = 2):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer) + 6,  # padded logits width, as in real models
                         hidden_size=32, intermediate_size=64, num_hidden_layers=layers,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         eos_token_id=tokenizer.eos_token_id, tie_word_embeddings=False)
    model = LlamaForCausalLM(config).eval()
    with torch.no_grad():  # larger logits than the default init: peaked, distinct distributions
        model.lm_head.weight.mul_(SCALE)
    return model


@pytest.fixture(scope="session")
def tiny_target(tiny_tokenizer):
    return tiny_model(tiny_tokenizer, seed=0)


@pytest.fixture(scope="session")
def tiny_draft(tiny_tokenizer):
    return tiny_model(tiny_tokenizer, seed=1, layers=1)
