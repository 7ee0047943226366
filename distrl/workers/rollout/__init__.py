"""The engine side: a rollout worker over one vLLM engine, its thread, sampling parameters, episodes and adapters."""
