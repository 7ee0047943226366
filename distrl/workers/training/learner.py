"""Learner: the policy model trained with `distrl.algo.compute_loss` by the shared training core (`Trainer`), its
log-probs, its weight export and its part of the checkpoints. Plain class, no Ray.

One `update(batch)` call runs `ppo_epochs` passes over this learner's shard of the step batch, one optimizer step
per mini-batch, micro-batches accumulated in between (see `distrl.workers.training.trainer` for the exact global
normalisation over micro-batches and learners).
"""

from __future__ import annotations

import atexit

import torch

from distrl import checkpoint
from distrl.algo import LossInputs, compute_loss
from distrl.algo.loss import MERGE
from distrl.config import LearnerConfig, LossConfig, ModelConfig
from distrl.merging import Figures
from distrl.types.batches import Sequences, TrainBatch, on_host
from distrl.workers.device import granted_device, to_device
from distrl.workers.model_files import DTYPES, tokenizer_path
from distrl.workers.training import dist, lora, moe
from distrl.workers.training.kernels import apply_kernels
from distrl.workers.training.model import response_logprobs, score_rows
from distrl.workers.training.packing import Layout
from distrl.workers.training.strategy import make_strategy
from distrl.workers.training.trainer import Counts, Measured, NonFiniteError, Trainer
from distrl.workers.weights import export, fingerprint, nccl
from distrl.workers.weights.fingerprint import Fingerprint, Region
from distrl.workers.weights.hf_export import HFExport
from distrl.workers.weights.pieces import Pieces

__all__ = ["Learner", "NonFiniteError"]


class Learner:
    """Trains the policy. With M learners, each receives 1/M of every mini-batch and holds a full replica
    (`learner.strategy: replicate`) or 1/M of the model (`fsdp`; the model is then built once the learners'
    process group is joined, in `connect`). `share_device`: a hybrid actor's engine and reference will share the
    device, and resolve an `auto` token budget once they are built (`Trainer.resolve_token_budget`)."""

    def __init__(self, model: ModelConfig, cfg: LearnerConfig, loss: LossConfig, *, temperature: float,
                 norm_len: int, mini_batch_size: int, total_optimizer_steps: int, seed: int, num_gpus: float = 0.0,
                 share_device: bool = False):
        torch.manual_seed(seed)
        self.cfg, self.loss_cfg, self.model_cfg = cfg, loss, model
        self.temperature, self.norm_len = temperature, norm_len
        self.mini_batch_size, self.total_optimizer_steps = mini_batch_size, total_optimizer_steps
        self.device = granted_device(num_gpus, "learner")
        self.share_device = share_device
        self.strategy = make_strategy(cfg, self.device)
        if not self.strategy.sharded:
            self._build()
        self._proximal: list[torch.Tensor] = []  # see proximal_logprobs
        self.updates = 0  # the policy version of these weights: updates applied since step 0

    def _build(self) -> None:
        self.model = apply_kernels(self.strategy.build(self.model_cfg), self.cfg.kernels, self.device,
                                   "learner.kernels")
        self.trainer = Trainer(self.model, self.cfg, self.total_optimizer_steps, self.device, self.mini_batch_size,
                               self.strategy, role="learner", share_device=self.share_device)

    # ------------------------------------------------------------------------------------------ data parallelism
    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int,
                timeout_s: float = dist.default_pg_timeout.total_seconds()) -> str:
        """Join the learners' process group (and build a sharded model over it); returns the backend (gloo on CPU,
        NCCL on GPU). `timeout_s` bounds each of its collectives (`dist.init_process_group`)."""
        backend = dist.init_process_group(master_addr, master_port, rank, world_size, self.device, timeout_s,
                                          self.cfg.sequence_parallel_size)
        atexit.register(self.close)  # a graceful exit (SIGTERM in a Ray actor, the end of a process) leaves first
        if self.strategy.sharded:
            self._build()
        return backend

    def close(self) -> None:
        """Drop the model and optimizer and leave the learners' group, ending its threads while the interpreter runs
        (`dist.leave_process_group` says why); run at exit once `connect` joined one. The learner is unusable after.
        `ray.kill` ends the process without it, and without the interpreter's finalization that needs it."""
        atexit.unregister(self.close)
        self.__dict__.pop("model", None)  # a sharded model (its FSDP state) holds the group
        self.__dict__.pop("trainer", None)
        dist.leave_process_group()

    # ------------------------------------------------------------------------------------------------- scoring
    def logprobs(self, sequences: Sequences, temperature: float | None = None) -> torch.Tensor:
        """Current-policy log-probs of the response tokens, no gradient: `[B, T]` float32 on CPU. Called before
        `update` they are the old log-probs of decoupled PPO. `temperature` defaults to the sampling temperature
        (1.0 gives the raw model log-probs, e.g. to compare with vLLM's prompt log-probs)."""
        return self._score(sequences, temperature)

    def ref_logprobs(self, sequences: Sequences) -> torch.Tensor:
        """The reference's log-probs of the response tokens with `learner.lora`: the base model, the adapters
        disabled (peft's `disable_adapter`), at the sampling temperature, as `ReferenceWorker.logprobs` gives them:
        `[B, T]` float32 on CPU. The base never changes, so any time gives the same answer."""
        if self.cfg.lora is None:
            raise RuntimeError("Learner.ref_logprobs: the learners answer for the reference only with learner.lora "
                               "(otherwise a reference actor holds the reference model)")
        with self.model.disable_adapter():  # type: ignore[operator]
            return self._score(sequences, None)

    def _score(self, sequences: Sequences, temperature: float | None) -> torch.Tensor:
        """Log-probs in the micro-batches the update forms (its token budget, in lockstep with the other learners)."""
        t = self.temperature if temperature is None else temperature
        seqs = on_host(sequences)  # micro-batches and layouts are made there
        self.model.eval()
        try:
            return score_rows(lambda micro, layout: response_logprobs(self.model, micro, t, layout=layout)[0],
                              seqs, self.trainer.micro_batches(seqs), self.device, dist.sequence_split())
        finally:
            self.model.train()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch) -> Figures:
        """PPO epochs over this learner's shard (`Trainer.update`). Returns figures to merge over learners with
        `distrl.merging.merge`, weighted by `learner/tokens`."""
        batch = on_host(batch)  # micro-batches and their layouts are made there
        if batch.old_logprobs is None and (self.cfg.ppo_epochs > 1
                                           or len(self.trainer.mini_batch_rows(batch)) > 1):
            raise ValueError("a batch without old log-probs must be one optimizer step (one mini-batch, one PPO "
                             "epoch): only then are the update's own log-probs, detached, the proximal policy's")
        self._proximal = []
        figs = self.trainer.update(batch, self._policy_loss)
        if batch.old_logprobs is None:  # back into row order: micro-batches may group rows in another order
            proximal = torch.zeros(batch.response_mask.shape, dtype=torch.float32, device=self.device)
            for rows, old in zip(self.trainer.micro_rows, self._proximal, strict=True):
                proximal[to_device(torch.tensor(rows, dtype=torch.long), self.device)] = old
            self._proximal = [proximal.cpu()]  # one copy back, once the step has been read
        self.updates += 1
        return figs

    def _policy_loss(self, model: torch.nn.Module, micro: TrainBatch, counts: Counts,
                     layout: Layout | None = None) -> tuple[torch.Tensor, Measured]:
        """The `Objective` of the policy: `compute_loss` on the micro-batch's log-probs under `model`, plus a mixture of
        experts' load-balancing term (`learner.router_aux_loss_coef`) and router figures (`moe.router_terms`)."""
        with moe.recorded_router_logits(model) as router_logits:
            logprobs, entropy = response_logprobs(model, micro.sequences, self.temperature,
                                                  with_entropy=self.loss_cfg.entropy_coef > 0, layout=layout)
        old = micro.old_logprobs
        if old is None:  # one optimizer step from these weights: its log-probs are the proximal policy's
            old = logprobs.detach()
            self._proximal.append(old.float().masked_fill(micro.response_mask == 0, 0.0))  # micro order, on device
        out = compute_loss(
            LossInputs(logprobs=logprobs, old_logprobs=old, advantages=micro.advantages, mask=micro.response_mask,
                       rollout_logprobs=micro.rollout_logprobs, ref_logprobs=micro.ref_logprobs, entropy=entropy,
                       cov_selected=micro.cov_selected, num_tokens=counts.num_tokens, num_seqs=counts.num_seqs,
                       norm_len=self.norm_len),
            self.loss_cfg,
        )
        figures: Measured = {key: (value, MERGE[key]) for key, value in out.tensors.items()}
        if not router_logits:
            return out.loss, figures
        share = micro.response_mask.sum() / max(counts.num_tokens, 1.0)
        term, routing = moe.router_terms(router_logits, model.config, self.cfg.router_aux_loss_coef, share)
        return out.loss if term is None else out.loss + term, {**figures, **routing}

    def weights_version(self) -> int:
        """The policy version of the weights held now (what `weight_bucket` called next sends)."""
        return self.updates

    def proximal_logprobs(self) -> torch.Tensor:
        """`[B, T]` float32 on CPU, 0 past each response: the old log-probs the last `update` took from its own
        forward pass (its batch had none), in the rows' order, for the driver's mismatch-by-staleness metrics."""
        if not self._proximal:
            raise RuntimeError("Learner.proximal_logprobs: the last update was given its old log-probs")
        return torch.cat(self._proximal)

    # ------------------------------------------------------------------------------------------- weight export
    # Every learner is called for every export (`distrl.workers.weights.export`); learner 0 answers, the others return
    # nothing. With replicas the others have nothing to do; a sharded strategy gathers here.
    def weight_specs(self, bucket_bytes: int, dtype: str) -> list[export.Spec]:
        """Bucket layout of the exported weights: buckets of about `bucket_bytes` in `dtype`, (name, shape) each."""
        return export.specs(self.model, bucket_bytes, dtype)

    def weight_bucket(self, spec: export.Spec, dtype: str) -> export.Bucket:
        """One bucket of `weight_specs` whole: its HF-named weights, cast to `dtype`, on CPU (learner 0; the others
        return an empty bucket; sharded weights are gathered, every learner taking part), pickled as raw bytes
        (`export.Bucket`). What a push sends is `weight_pieces`; this reads the weights whole (tools, tests)."""
        return export.Bucket(self.strategy.bucket(self.model, spec, dtype))

    def local_bucket(self, spec: export.Spec, dtype: str) -> dict[str, torch.Tensor]:
        """One bucket of `weight_specs` in `dtype` on this learner's device, on every learner (a hybrid actor loads
        its own engine, in memory; sharded weights are gathered, every learner taking part). With the replicate
        strategy and `dtype` the training dtype, the tensors are the model's own."""
        return self.strategy.bucket(self.model, spec, dtype, device=self.device, every_rank=True)

    def weight_pieces(self, spec: export.Spec, dtype: str) -> Pieces:
        """This learner's pieces of one bucket of `weight_specs`, cast to the rollout dtype, on CPU, pickled as raw
        bytes (engines map them, not copy them): its own rows of each tensor, so that no learner sends (or gathers)
        the whole model; replicas' learner 0 sends every tensor whole. With `learner.lora` the pieces are the
        adapters, whole, from learner 0 (megabytes), or with `serve: merged` each learner's rows of the adapted
        blocks merged (`lora.Merged`)."""
        if self.cfg.lora is not None and self.cfg.lora.serve == "adapters":
            return Pieces.whole(self.strategy.bucket(self.model, spec, dtype))
        return self.strategy.pieces(self.model, spec, dtype)

    def weights_fingerprint(self, dtype: str, regions: dict[str, list[Region]] | None = None) -> Fingerprint:
        """This learner's part of the fingerprint of the exported weights as sent (cast to the rollout `dtype`), for
        `regions` (tensor name -> the regions the engines' workers hold: `RolloutWorker.weight_regions`; None: every
        tensor whole, as an engine at TP 1 holds them): every
        learner fingerprints the rows it sends (`fingerprint.of_blocks`), and an engine adds the parts
        (`fingerprint.add`). Nothing is gathered; with `learner.lora` served as adapters, learner 0 fingerprints them
        as the engines hold them (B scaled: `lora.served_tensors`)."""
        if self.cfg.lora is not None and self.cfg.lora.serve == "adapters":
            served = lora.served_tensors(export.exported(self.model), DTYPES[dtype], self.cfg.lora.scaling)
            blocks = ((name, t, 0, t.shape[0]) for name, t in served) if dist.rank() == 0 else iter(())
            return fingerprint.of_blocks(blocks, regions, DTYPES[dtype])
        return fingerprint.of_blocks(self.strategy.own_blocks(self.model), regions, DTYPES[dtype])

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (this actor's node): the rendezvous of the learners' group and of the NCCL
        weight world."""
        return dist.free_port(host)

    def nccl_connect(self, host: str, port: int, world_size: int, timeout_s: float) -> None:
        """Join the NCCL weight-sync world as rank 0 (`nccl.make_communicator`), waiting `timeout_s` for the
        engines; a communicator of an earlier world is dropped."""
        self._nccl = nccl.make_communicator(host, port, 0, world_size, timeout_s)

    def nccl_send(self, specs: list[nccl.Spec], dtype: str) -> None:
        """Broadcast the buckets `specs` (the layout every receiver was given) from learner 0 (the others have
        nothing to send). Each bucket is made on this learner's device, where the broadcast reads it: sharded, it is
        gathered there in `dtype` and stays there (no copy through the CPU)."""
        for spec in specs:
            bucket = self.strategy.bucket(self.model, spec, dtype, device=self.device)  # every learner gathers
            if dist.rank() == 0:
                nccl.send_bucket(self._nccl, bucket)

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str, hf_dtype: str = "bfloat16") -> checkpoint.FileList:
        """Write this learner's part of a checkpoint (the policy in HF format in `hf_dtype`, the rollout dtype, with
        its tokenizer, or its adapters in PEFT's format with `learner.lora`; the float32 weights, optimizer and
        schedule state) to `directory`, which the driver made (`checkpoint.begin`). Every learner is called
        (`Trainer.save`); returns the files this one wrote."""
        return self.trainer.save(directory, HFExport(hf_dtype, tokenizer_path(self.model_cfg),
                                                     self.model_cfg.trust_remote_code))

    def seen_digest(self, path: str) -> str | None:
        """`checkpoint.seen_digest` on this learner's node, where its checkpoints are written."""
        return checkpoint.seen_digest(path)

    def load_checkpoint(self, directory: str, step: int) -> None:
        """Continue from the policy part `directory` of the checkpoint of `step`: weights, optimizer, schedule and
        step counters."""
        self.trainer.load(directory)
        self.updates = step
