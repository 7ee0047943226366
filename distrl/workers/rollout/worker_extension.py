"""`EngineWorker`: the methods distrl adds to every worker process of a vLLM engine (vLLM's `worker_extension_cls`),
called by name through `LLM.collective_rpc`, so that each runs in every worker at once: in the rollout actor's own
process at TP 1 (vLLM's in-process executor), in each of the k worker processes of a tensor-parallel engine.

A weight push is three calls (`distrl_begin_reload`, `distrl_load` once per bucket, `distrl_finish_reload`): vLLM's
layer-wise in-place reload (`reload_weights`' own steps) held open across the buckets, so that a worker loads each
bucket as it comes and the engine holds one bucket at a time. Each worker is handed the bucket's full HF tensors,
in its own process at TP 1, mapped from the rollout actor's shared memory at TP k (`shared_bucket`), and vLLM's
weight loaders copy out the slice of each that its rank holds.

Plain code, no Ray; the methods' names start with `distrl_` (vLLM refuses an extension whose names clash with the
worker's own).
"""

from __future__ import annotations

import os
from typing import Any

import torch

from distrl.workers.rollout import cpu_experts, engine_names, lora_engine, served_weights, shared_bucket
from distrl.workers.rollout.shared_bucket import SharedBucket
from distrl.workers.weights import nccl
from distrl.workers.weights.fingerprint import Fingerprint, Held

WORKER_EXTENSION = f"{__name__}.EngineWorker"
"""The qualified name vLLM's engine arguments take (`worker_extension_cls`)."""


class EngineWorker:
    """Mixed into vLLM's worker class: `self` is the worker (`self.model_runner`, `self.vllm_config`, `self.rank`)."""

    model_runner: Any
    vllm_config: Any
    rank: int
    _distrl_nccl: Any = None
    _distrl_device: torch.device | None = None

    def _distrl_model(self) -> torch.nn.Module:
        return self.model_runner.get_model()

    def distrl_pid(self) -> int:
        """This worker's process id."""
        return os.getpid()

    # ----------------------------------------------------------------------------------------------- weight loads
    def distrl_begin_reload(self) -> None:
        """Open a layer-wise in-place reload: each layer is processed (on CPU: repacked) once all its tensors are in."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import initialize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            initialize_layerwise_reload(self._distrl_model())

    def distrl_load(self, bucket: dict[str, torch.Tensor] | SharedBucket) -> list[int]:
        """Load one bucket of HF-named full tensors into the open reload; returns the shared segments this worker
        still holds views of (vLLM keeps an unfinished layer's tensors), which the rollout actor must not write."""
        from vllm.config import set_current_vllm_config

        model_type = self.vllm_config.model_config.hf_config.model_type
        named = ((engine_names.to_engine(name, model_type), tensor) for name, tensor in bucket.items())
        with set_current_vllm_config(self.vllm_config):
            self._distrl_model().load_weights(named)  # type: ignore[operator]  # a vLLM model's own loader
        return shared_bucket.held_segments() if isinstance(bucket, SharedBucket) else []

    def distrl_finish_reload(self) -> None:
        """Close the reload (layers not processed yet are processed now) and drop what the old weights cached."""
        from vllm.config import set_current_vllm_config
        from vllm.model_executor.model_loader.reload.layerwise import finalize_layerwise_reload

        with set_current_vllm_config(self.vllm_config):
            finalize_layerwise_reload(self._distrl_model(), self.vllm_config.model_config)
        cpu_experts.pack_after_reload(self._distrl_model())  # vLLM 0.32's CPU reload leaves the experts unpacked
        self.model_runner.reset_lora_state()
        self.model_runner.reset_encoder_cache()
        self.model_runner.reset_mm_cache()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()  # the reload's staging blocks back to the device, outside vLLM's budget

    # ------------------------------------------------------------------------------------------------ fingerprints
    def distrl_regions(self) -> Held:
        """The regions of HF tensors this worker holds (`served_weights.served_regions`)."""
        return served_weights.served_regions(self._distrl_model(), self.vllm_config.model_config.hf_config.model_type)

    def distrl_fingerprint(self) -> Fingerprint:
        """The fingerprint of what this worker serves (`served_weights.served_fingerprint`)."""
        model_type = self.vllm_config.model_config.hf_config.model_type
        return served_weights.served_fingerprint(self._distrl_model(), model_type)

    # --------------------------------------------------------------------------------------------------- adapters
    def distrl_register_adapter(self, version: int, tensors: dict[str, torch.Tensor], peft_cfg: dict[str, Any],
                                previous: int | None) -> int:
        """`lora_engine.register` in this worker (each rank's LoRA layers keep their slice of the adapters)."""
        return lora_engine.register(self, version, tensors, peft_cfg, previous)

    def distrl_adapter_fingerprint(self, version: int, rank: int) -> Fingerprint:
        """`lora_engine.slot_fingerprint` in this worker."""
        return lora_engine.slot_fingerprint(self, version, rank)

    def distrl_adapter_regions(self) -> Held:
        """`lora_engine.slot_regions` in this worker."""
        return lora_engine.slot_regions(self)

    # ------------------------------------------------------------------------------------------------------- NCCL
    def distrl_nccl_connect(self, host: str, port: int, first_rank: int, world_size: int, timeout_s: float) -> None:
        """Join the NCCL weight-sync world as rank `first_rank` + this worker's rank in its engine."""
        self._distrl_nccl = nccl.make_communicator(host, port, first_rank + self.rank, world_size, timeout_s)
        self._distrl_device = torch.device("cuda", torch.cuda.current_device())

    def distrl_nccl_receive(self, specs: list[nccl.Spec], dtype: str) -> None:
        """Receive learner 0's broadcast of `specs` bucket by bucket, each loaded before the next is received, in one
        reload (one bucket on the device at a time, beside the weights)."""
        from distrl.workers.model_files import DTYPES

        assert self._distrl_device is not None, "distrl_nccl_connect first"
        self.distrl_begin_reload()
        for bucket in nccl.receive_buckets(self._distrl_nccl, specs, DTYPES[dtype], self._distrl_device):
            self.distrl_load(bucket)
            del bucket
        self.distrl_finish_reload()
