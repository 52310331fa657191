"""Fixtures shared by several test modules."""

import pytest

from tiny_models import tiny_model, word_tokenizer


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its word tokenizer saved as a model directory (what load() reads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)
