"""The README's install lines name extras that exist, spelled so that every pip installs them."""

from __future__ import annotations

import importlib.metadata
import re
from pathlib import Path

import pytest

from speculum.models import PACKAGED_MODELS

ROOT = Path(__file__).resolve().parents[1]
tomllib = pytest.importorskip("tomllib")


def normalized(name: str) -> str:
    """What pip (PEP 685) turns an extra's name into."""
    return re.sub(r"[-_.]+", "-", name).lower()


def extras_named_in(text: str) -> set[str]:
    return {extra.strip() for group in re.findall(r"(?:speculum|\"\.)\[([^\]]+)\]", text) for extra in group.split(",")}


def test_readme_and_registry_name_declared_extras():
    declared = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["optional-dependencies"]
    # pip 23 matches an extra only when it is written exactly as declared and declared normalised
    assert all(normalized(name) == name for name in declared), sorted(declared)
    named = extras_named_in((ROOT / "README.md").read_text())
    named |= extras_named_in(" ".join(entry.pip for entry in PACKAGED_MODELS.values()))
    assert {"gemma", "test", "qwen-0-5b", "qwen-1-5b"} <= named
    assert named <= set(declared), named - set(declared)


def test_installed_metadata_provides_the_extras():
    provided = set(importlib.metadata.metadata("speculum").get_all("Provides-Extra") or [])
    if "qwen-0-5b" not in provided:
        pytest.skip("the installed speculum metadata predates this checkout (reinstall with pip install -e .)")
    named = extras_named_in((ROOT / "README.md").read_text())
    assert named <= provided
    requirements = importlib.metadata.requires("speculum") or []
    for extra in ("qwen-0-5b", "qwen-1-5b", "gemma"):
        assert any(f'extra == "{extra}"' in req for req in requirements), extra
