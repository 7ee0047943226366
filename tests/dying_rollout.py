"""Rollout workers for unit tests of in-job recovery: the HF-sampling worker of `tests.hf_rollout`, made to die in
a given call the way a killed actor does (that call and every later call on the instance raise `ActorLost`).

`dying(method, at_call, deaths)` makes a class whose first `deaths` instances die in their `at_call`-th call of
`method` ("generate", "continue_samples" or "load_weights"); instances made later (the replacements) live, unless
`deaths` is larger than the number of instances the run makes, in which case every replacement dies too.
"""

from __future__ import annotations

from typing import Any

from distrl.cluster.backend import ActorLost
from tests.hf_rollout import HFRolloutWorker


def dying(method: str, at_call: int, deaths: int = 1) -> type[HFRolloutWorker]:
    class Dying(HFRolloutWorker):
        left = deaths  # instances still to die
        made = 0  # instances made, the replacements included

        def __init__(self, *args: Any, **kwargs: Any):
            super().__init__(*args, **kwargs)
            Dying.made += 1
            self.doomed, self.dead, self.count = Dying.left > 0, False, 0
            Dying.left -= self.doomed

        def _maybe_die(self, name: str) -> None:
            if self.dead:
                raise ActorLost("the actor is dead")
            if name == method:
                self.count += 1
                if self.doomed and self.count == at_call:
                    self.dead = True
                    raise ActorLost(f"killed in {name} call {at_call}")

        def generate(self, *args: Any, **kwargs: Any) -> Any:
            self._maybe_die("generate")
            return super().generate(*args, **kwargs)

        def continue_samples(self, *args: Any, **kwargs: Any) -> Any:
            self._maybe_die("continue_samples")
            return super().continue_samples(*args, **kwargs)

        def load_weights(self, *args: Any, **kwargs: Any) -> Any:
            self._maybe_die("load_weights")
            return super().load_weights(*args, **kwargs)

    return Dying
