"""Reward functions that misbehave, for the error-path tests (imported by Ray reward tasks by spec)."""


def always_raises(prompt: str, completion: str, sample: dict) -> float:
    raise ZeroDivisionError("this reward function always fails")


def dies_once(prompt: str, completion: str, sample: dict) -> float:
    """Kills its own process the first time (the marker file `sample["marker"]` records it), then scores 1.0: an
    infrastructure failure, as when a reward worker is killed or its node is lost."""
    import os
    from pathlib import Path

    marker = Path(sample["marker"])
    if not marker.exists():
        marker.write_text("died once")
        os._exit(1)
    return 1.0
