"""speculum's drafters inside other serving engines (vLLM: :mod:`speculum.integrations.vllm`)."""
