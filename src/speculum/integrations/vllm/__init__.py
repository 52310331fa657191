"""speculum's drafters and controller inside vLLM, through its ``custom_class`` proposer interface.

    vllm serve MODEL --speculative-config \\
        '{"model": "speculum.integrations.vllm.Auto", "num_speculative_tokens": 8}'

``PromptLookup``, ``Anpd`` and ``Auto`` are the names vLLM is given (see
:mod:`speculum.integrations.vllm.proposers` and docs/serving-with-vllm.md). Nothing here imports
vLLM: the classes take vLLM's config object and numpy arrays, so they are tested without it.
"""

from speculum.integrations.vllm.proposers import Anpd, Auto, PromptLookup

__all__ = ["Anpd", "Auto", "PromptLookup"]
