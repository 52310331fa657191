"""A ``custom_class`` proposer that proposes the same token everywhere: any proposal must leave
vLLM's sampled output distributed as the target's, so this one shows whether vLLM's rejection
sampling of token-only drafts keeps to it."""

from __future__ import annotations

TOKEN = 70


class AlwaysTheSameToken:
    def __init__(self, vllm_config) -> None:
        self.k = vllm_config.speculative_config.num_speculative_tokens

    def load_model(self, *args, **kwargs) -> None:
        pass

    def dummy_run(self, *args, **kwargs) -> None:
        pass

    def propose(self, sampled_token_ids, num_tokens_no_spec, token_ids_cpu, slot_mappings=None):
        return [[TOKEN] * self.k if len(sampled) else [] for sampled in sampled_token_ids]
