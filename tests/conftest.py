"""Fixtures shared by several test modules."""

import os

import pytest

# dtype="auto" measures the machine once and caches it in the user's cache directory: the suite keeps
# to the flag rule instead (deterministic, and nothing written to ~/.cache); test_dtype_choice tests
# the measuring itself.
os.environ.setdefault("SPECULUM_DTYPE_MEASURE", "0")
# the same for padding small forwards (speculum.row_padding.choose_row_padding; test_accel tests it)
os.environ.setdefault("SPECULUM_ROW_PADDING", "0")

from tiny_models import tiny_model, word_tokenizer


@pytest.fixture(autouse=True, scope="session")
def _cost_cache(tmp_path_factory):
    """Measured cost models (speculum.costs) go to a temporary directory, not the user's cache."""
    import speculum.costs

    path = tmp_path_factory.mktemp("costs")
    original = speculum.costs.costs_dir
    speculum.costs.costs_dir = lambda: path
    yield path
    speculum.costs.costs_dir = original


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Llama and its word tokenizer saved as a model directory (what load() reads)."""
    path = tmp_path_factory.mktemp("tiny-llama")
    tiny_model("llama").save_pretrained(path)
    word_tokenizer().save_pretrained(path)
    return str(path)
