"""Rows in the layouts the standards' own trainers read, made here instead of read from a hub."""

from __future__ import annotations

from typing import Any


def skyrl_gsm8k(count: int, max_turns: int = 2) -> list[dict[str, Any]]:
    """`count` rows as SkyRL's GSM8k data holds them: chat messages, the environment class, the reward spec."""
    return [{"prompt": [{"role": "user", "content": f"Tom has {a} apples and buys {a + 2}. How many has he?"}],
             "env_class": "gsm8k_multi_turn", "reward_spec": {"method": "rule", "ground_truth": str(2 * a + 2)},
             "extra_info": {}, "max_turns": max_turns} for a in range(count)]
