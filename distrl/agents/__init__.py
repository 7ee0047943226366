"""Agents: environments, tools, the sandbox and the assembly of token-exact multi-turn trajectories.

Plain code, no Ray: the rollout worker drives episodes through these pieces (`distrl.workers.rollout.episodes`), and the
cluster layer hosts environments in actors of their own. The driver still sees `Rollouts`, now with a loss mask and
per-token policy versions; a reward-function job is a one-turn episode through the same path.
"""
