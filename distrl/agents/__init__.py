"""Multi-turn, tool-using rollouts as plain code (no Ray, no vLLM): environments, tools, the sandbox, trajectories."""
