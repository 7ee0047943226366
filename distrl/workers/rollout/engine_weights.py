"""`EngineWeights`: the weights a rollout engine serves, across its worker processes.

A push reaches every worker of the engine (`load`): vLLM's layer-wise in-place reload is opened in each, every
bucket is assembled from the learners' pieces and handed to all of them at once, and the reload is closed. At TP 1
the one worker runs in this process and takes the bucket's tensors as they are (mapped from the object store when
one learner held them whole); at TP k the bucket is written once into shared memory that the k workers map
(`shared_bucket`: a pool of segments, each written again once no worker holds a view of it), and each worker's
loaders copy out its own slice. No worker is sent a copy of the model.

Each worker then proves what it serves (`check`): its fingerprint, keyed by HF name and by the region of the tensor
it holds, against the learners' fingerprint of the same regions of what they sent; a mismatch names the engine, the
worker and the tensor. With `learner.lora` the pushes carry adapters, registered in every worker's LoRA slot (they
are small: each worker is given them whole, and vLLM's LoRA layers keep their rank's slice).

Every method runs on the engine's thread (`EngineLoop`), between two engine steps. Plain code, no Ray.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from distrl.workers.rollout import shared_bucket
from distrl.workers.weights import fingerprint
from distrl.workers.weights.fingerprint import Fingerprint, Held, Region, key
from distrl.workers.weights.pieces import BucketParts, assemble


class EngineWeights:
    """The weights of `llm` (a `vllm.LLM` whose workers carry `worker_extension.EngineWorker`), served by `workers`
    worker processes (its tensor-parallel size; 1: in this process). `lora_rank`: the pushes carry adapters of
    that rank (`learner.lora`); None: full weights."""

    def __init__(self, llm: Any, workers: int, lora_rank: int | None):
        self.llm, self.workers, self.lora_rank = llm, workers, lora_rank
        self._regions: list[Held] | None = None
        self.pool = shared_bucket.SharedPool() if workers > 1 else None  # the segments the workers map

    def load(self, buckets: Iterable[BucketParts]) -> None:
        """Load `buckets` into every worker in place, one bucket at a time, each fetched only when its turn comes."""
        self.llm.collective_rpc("distrl_begin_reload")
        for bucket in buckets:
            self._load_bucket(bucket)
            del bucket  # else the loop variable keeps this bucket alive while the next one arrives
        self.llm.collective_rpc("distrl_finish_reload")

    def _load_bucket(self, bucket: BucketParts) -> None:
        if self.pool is None:
            self.llm.collective_rpc("distrl_load", args=(assemble(bucket),))
            return
        assemble(bucket, self.pool.allocate)  # written into a free segment; this process keeps no view of it
        held = self.llm.collective_rpc("distrl_load", args=(self.pool.bucket,))
        self.pool.held(set().union(*held))

    def register_adapters(self, version: int, tensors: dict[str, Any], peft_cfg: dict[str, Any],
                          previous: int | None) -> int:
        """Make `tensors` (PEFT-named) the adapters of `version` in every worker's slot; returns the adapter modules
        loaded in each (the same number in all). Raises RuntimeError if they match no layer."""
        loaded = self.llm.collective_rpc("distrl_register_adapter", args=(version, tensors, peft_cfg, previous))
        if min(loaded) == 0:
            raise RuntimeError(f"the adapters of version {version} ({len(tensors)} tensors) match no layer of the "
                               f"engine's model")
        return loaded[0]

    def regions(self) -> list[Held]:
        """Each worker's regions of the tensors (HF names, or PEFT names of adapters) it holds (fixed once built)."""
        if self._regions is None:
            adapters = self.lora_rank is not None
            self._regions = self.llm.collective_rpc("distrl_adapter_regions" if adapters else "distrl_regions")
        return self._regions

    def union_of_regions(self) -> dict[str, list[Region]]:
        """Every region any worker holds, by tensor name: what the learners fingerprint for a check."""
        out: dict[str, list[Region]] = {}
        for regions in self.regions():
            for name, region in regions:
                if region not in out.setdefault(name, []):
                    out[name].append(region)
        return out

    def check(self, expected: Fingerprint, engine: str, version: int, adapter_version: int | None = None) -> None:
        """Raise WeightMismatch, naming the engine, the worker and the first tensor, unless every worker serves the
        regions it should hold as `expected` (the learners' fingerprint of them). With adapters, `adapter_version` is
        the version whose slot the requests now carry (None: no adapters served yet, so none match)."""
        if self.lora_rank is None:
            served = self.llm.collective_rpc("distrl_fingerprint")
        elif adapter_version is None:
            served = [{}] * self.workers
        else:
            served = self.llm.collective_rpc("distrl_adapter_fingerprint", args=(adapter_version, self.lora_rank))
        pushed = {k.partition("[")[0] for k in expected}  # the tensors the learners sent (a key is name[region])
        unheld = sorted(pushed - {name for regions in self.regions() for name, _ in regions})
        if unheld:
            raise fingerprint.WeightMismatch(f"{engine} serves no tensor named {unheld[0]} ({len(unheld)} of the "
                                             f"pushed tensors) after loading version {version}")
        for rank, (regions, got) in enumerate(zip(self.regions(), served, strict=True)):
            # What this worker holds of the pushed tensors (with adapters, the LoRA layers of projections that
            # `learner.lora` does not target hold none of them).
            keys = [key(name, region) for name, region in regions if name in pushed]
            missing = [k for k in keys if k not in expected]
            if missing:
                raise fingerprint.WeightMismatch(
                    f"the learners' fingerprint of version {version} has no entry for {missing[0]} ({len(missing)} "
                    f"missing), which {engine}'s worker {rank} holds: the learners were not asked for its region")
            who = engine if self.workers == 1 else f"{engine} (worker {rank} of {self.workers})"
            fingerprint.check({k: expected[k] for k in keys}, got, who, version)
