"""Learner: an HF model + AdamW that takes PPO/GSPO steps with `distrl.algo.compute_loss`. Plain class, no Ray.

One `update(batch)` call runs `ppo_epochs` passes over this learner's shard of the step batch, one optimizer step
per mini-batch, micro-batches accumulated in between. Normalisation is global: every micro-batch divides by the
token and sequence counts of the whole mini-batch *across all learners*, and gradients are summed across learners,
so M learners x k micro-batches produce exactly the gradient of one full-batch loss.
"""

from __future__ import annotations

import math
from collections import defaultdict
from pathlib import Path

import torch

from distrl import checkpoint
from distrl.algo import LossInputs, compute_loss
from distrl.config import LearnerConfig, LossConfig, ModelConfig
from distrl.micro_batches import micro_batches
from distrl.types import Sequences, TrainBatch
from distrl.workers import dist, fingerprint, nccl
from distrl.workers.device import granted_device
from distrl.workers.fingerprint import Fingerprint
from distrl.workers.model import DTYPES, load_causal_lm, response_logprobs, score_in_micro_batches
from distrl.workers.optim import build_optimizer


def merge_metrics_lists(values: dict[str, list[float]], weights: list[float] | None = None) -> dict[str, float]:
    """One figure per key from several micro-batches, mini-batches or learners, given each part's response-token
    count in `weights`. Per-token figures (clip_frac, kl_ref, is_weight_mean, ...) take the token-weighted mean, so
    they come out as over the whole batch; `*_min` / `*_max` the extreme over parts that have tokens;
    per-optimizer-step figures (`loss/*`, `learner/*`) the plain mean."""
    n = len(next(iter(values.values()), []))
    w = weights if weights and sum(weights) > 0 else [1.0] * n
    has_tokens = [wi > 0 for wi in w]
    merged = {}
    for key, vs in values.items():
        if key.endswith(("_min", "_max")):
            extreme = min if key.endswith("_min") else max
            merged[key] = extreme(v for v, keep in zip(vs, has_tokens, strict=True) if keep)
        elif key.startswith(("loss/", "learner/")):
            merged[key] = sum(vs) / len(vs)
        else:
            merged[key] = sum(wi * v for wi, v in zip(w, vs, strict=True)) / sum(w)
    return merged


def merge_metrics(results: list[dict[str, float]]) -> dict[str, float]:
    """Merge `Learner.update` metrics from the M learners, weighted by their response tokens (`learner/tokens`,
    which is summed)."""
    tokens = [r["learner/tokens"] for r in results]
    merged = merge_metrics_lists({key: [r[key] for r in results] for key in results[0]}, tokens)
    merged["learner/tokens"] = sum(tokens)
    return merged


class NonFiniteError(RuntimeError):
    """Too many consecutive optimizer steps had a non-finite loss or gradient norm."""


class Learner:
    """Trains the policy. With M learners, each holds a full replica and receives 1/M of every mini-batch."""

    def __init__(self, model: ModelConfig, cfg: LearnerConfig, loss: LossConfig, *, temperature: float,
                 norm_len: int, mini_batch_size: int, total_optimizer_steps: int, seed: int, num_gpus: float = 0.0):
        torch.manual_seed(seed)
        self.cfg, self.loss_cfg = cfg, loss
        self.temperature, self.norm_len = temperature, norm_len
        self.global_mini_batch_size = mini_batch_size
        self.device = granted_device(num_gpus, "learner")
        # Master weights and optimizer state stay float32; a lower learner.dtype is the autocast compute dtype
        # (pure bf16 weights would round most Adam updates of size ~lr away).
        self.model = load_causal_lm(model, "float32", device=self.device)
        self._autocast = torch.autocast(self.device, dtype=DTYPES[cfg.dtype], enabled=cfg.dtype != "float32")
        if cfg.gradient_checkpointing:
            self.model.gradient_checkpointing_enable()
            self.model.config.use_cache = False
        self.model.train()
        self.params = [p for p in self.model.parameters() if p.requires_grad]
        self.optimizer, self.scheduler = build_optimizer(self.model, cfg, total_optimizer_steps)
        self.optimizer_steps = 0
        self.skipped_steps = 0
        self._consecutive_nonfinite = 0
        self._proximal: list[torch.Tensor] = []  # see proximal_logprobs
        self.updates = 0  # the policy version of these weights: updates applied since step 0

    # ------------------------------------------------------------------------------------------ data parallelism
    def connect(self, master_addr: str, master_port: int, rank: int, world_size: int) -> str:
        """Join the learners' process group; returns the backend (gloo on CPU, NCCL on GPU)."""
        return dist.init_process_group(master_addr, master_port, rank, world_size, self.device)

    # ------------------------------------------------------------------------------------------------- scoring
    def logprobs(self, sequences: Sequences, temperature: float | None = None) -> torch.Tensor:
        """Current-policy log-probs of the response tokens, no gradient: `[B, T]` float32 on CPU. Called before
        `update` they are the old log-probs of decoupled PPO. `temperature` defaults to the sampling temperature
        (1.0 gives the raw model log-probs, e.g. to compare with vLLM's prompt log-probs)."""
        self.model.eval()
        try:
            with self._autocast:
                return score_in_micro_batches(self.model, sequences.to(self.device),
                                              self.temperature if temperature is None else temperature,
                                              self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch)
        finally:
            self.model.train()

    # ------------------------------------------------------------------------------------------------ training
    def update(self, batch: TrainBatch) -> dict[str, float]:
        """PPO epochs over this learner's shard (`TrainBatch.shard`: its j-th chunk of mini_batch_size / M rows
        is its part of global mini-batch j). Returns metrics merged over micro- and
        mini-batches by `merge_metrics_lists` (loss terms are first summed over a mini-batch's micro-batches and
        learners, giving each optimizer step's loss)."""
        batch = batch.to(self.device)
        local_mini = self.global_mini_batch_size // dist.world_size()
        if batch.old_logprobs is None and (self.cfg.ppo_epochs > 1 or batch.batch_size > local_mini):
            raise ValueError("a batch without old log-probs must be one optimizer step (one mini-batch, one PPO "
                             "epoch): only then are the update's own log-probs, detached, the proximal policy's")
        self._proximal = []
        per_mini: dict[str, list[float]] = defaultdict(list)
        tokens: list[float] = []
        for _ in range(self.cfg.ppo_epochs):
            for mini in batch.chunks(local_mini):
                for key, value in self._optimizer_step(mini).items():
                    per_mini[key].append(value)
                tokens.append(float(mini.response_mask.sum()))
        metrics = merge_metrics_lists(per_mini, tokens)
        metrics.update({"learner/lr": self.scheduler.get_last_lr()[0], "learner/skipped_steps": self.skipped_steps,
                        "learner/optimizer_steps": self.optimizer_steps,
                        "learner/tokens": float(batch.response_mask.sum())})
        self.updates += 1
        return metrics

    def weights_version(self) -> int:
        """The policy version of the weights held now (what `weight_bucket` called next sends)."""
        return self.updates

    def _optimizer_step(self, mini: TrainBatch) -> dict[str, float]:
        mask = mini.response_mask
        # Global normalisers: counts over this mini-batch on every learner.
        counts = dist.all_reduce_(torch.stack([mask.sum(), (mask.sum(-1) > 0).sum().to(mask.dtype)]).double())
        num_tokens, num_seqs = counts.tolist()
        per_micro: dict[str, list[float]] = defaultdict(list)
        micro_tokens: list[float] = []
        loss_sums: dict[str, float] = defaultdict(float)
        nonfinite_loss = 0.0
        proximal = torch.zeros_like(mask)  # in the mini-batch's row order, whatever the micro-batches' order
        lengths = mini.sequences.attention_mask.sum(-1).tolist()
        for rows in micro_batches(lengths, self.cfg.micro_batch_size, self.cfg.max_tokens_per_micro_batch):
            index = torch.tensor(rows, dtype=torch.long, device=mask.device)
            micro = mini.select(index)
            with self._autocast:
                logprobs, entropy = response_logprobs(self.model, micro.sequences, self.temperature,
                                                      with_entropy=self.loss_cfg.entropy_coef > 0)
            old = micro.old_logprobs
            if old is None:  # one optimizer step from these weights: its log-probs are the proximal policy's
                old = logprobs.detach()
                proximal[index] = old.float().masked_fill(micro.response_mask == 0, 0.0)
            out = compute_loss(
                LossInputs(logprobs=logprobs, old_logprobs=old, advantages=micro.advantages,
                           mask=micro.response_mask, rollout_logprobs=micro.rollout_logprobs,
                           ref_logprobs=micro.ref_logprobs, entropy=entropy, num_tokens=num_tokens,
                           num_seqs=num_seqs, norm_len=self.norm_len),
                self.loss_cfg,
            )
            if not torch.isfinite(out.loss):
                nonfinite_loss = 1.0
            out.loss.backward()
            micro_tokens.append(float(micro.response_mask.sum()))
            for key, value in out.metrics.items():
                # Loss terms are partial sums over the global count: they add up; ratios and fractions average.
                if key.startswith("loss/"):
                    loss_sums[key] += value
                else:
                    per_micro[key].append(value)
        if mini.old_logprobs is None:
            self._proximal.append(proximal.cpu())
        dist.all_reduce_grads_(self.params)
        flags = dist.all_reduce_(torch.tensor([nonfinite_loss, *loss_sums.values()], dtype=torch.float64,
                                              device=self.device))
        max_norm = self.cfg.max_grad_norm or math.inf
        grad_norm = float(torch.nn.utils.clip_grad_norm_(self.params, max_norm))
        skipped = flags[0].item() > 0 or not math.isfinite(grad_norm)
        if skipped:
            self._skip(grad_norm)
        else:
            self.optimizer.step()
            self.scheduler.step()
            self.optimizer_steps += 1
            self._consecutive_nonfinite = 0
        self.optimizer.zero_grad(set_to_none=True)
        metrics = merge_metrics_lists(per_micro, micro_tokens)
        metrics.update(dict(zip(loss_sums, flags[1:].tolist(), strict=True)))
        metrics["learner/grad_norm"] = grad_norm
        return metrics

    def proximal_logprobs(self) -> torch.Tensor:
        """`[B, T]` float32 on CPU, 0 past each response: the old log-probs the last `update` took from its own
        forward pass (its batch had none), in the rows' order, for the driver's mismatch-by-staleness metrics."""
        if not self._proximal:
            raise RuntimeError("Learner.proximal_logprobs: the last update was given its old log-probs")
        return torch.cat(self._proximal)

    def _skip(self, grad_norm: float) -> None:
        self.skipped_steps += 1
        self._consecutive_nonfinite += 1
        if self._consecutive_nonfinite >= self.cfg.max_consecutive_nonfinite:
            raise NonFiniteError(
                f"{self._consecutive_nonfinite} consecutive optimizer steps had a non-finite loss or gradient norm "
                f"(last grad norm {grad_norm}); stopping (learner.max_consecutive_nonfinite="
                f"{self.cfg.max_consecutive_nonfinite}). Lower learner.lr or check the rewards/advantages."
            )

    # ------------------------------------------------------------------------------------------- weight export
    def weight_specs(self, bucket_bytes: int, dtype: str) -> list[nccl.Spec]:
        """Bucket layout of the exported weights: buckets of about `bucket_bytes` in `dtype`, (name, shape) each."""
        item = torch.empty((), dtype=DTYPES[dtype]).element_size()
        specs: list[nccl.Spec] = [[]]
        size = 0
        for name, tensor in self.model.state_dict().items():
            if specs[-1] and size + tensor.numel() * item > bucket_bytes:
                specs.append([])
                size = 0
            specs[-1].append((name, tuple(tensor.shape)))
            size += tensor.numel() * item
        return specs

    def weight_bucket(self, spec: nccl.Spec, dtype: str) -> dict[str, torch.Tensor]:
        """One bucket of `weight_specs`: its HF-named weights, cast to the rollout dtype, on CPU."""
        state = self.model.state_dict()
        with torch.no_grad():
            return {name: state[name].detach().to("cpu", DTYPES[dtype]).contiguous() for name, _ in spec}

    def weights_fingerprint(self, dtype: str) -> Fingerprint:
        """Fingerprint of the exported weights as sent (cast to the rollout `dtype`), for the engines to check."""
        return fingerprint.of_tensors(self.model.state_dict().items(), DTYPES[dtype])

    def free_port(self, host: str) -> int:
        """A free TCP port on `host` (this actor's node): the rendezvous of the learners' group and of the NCCL
        weight world."""
        import socket

        with socket.socket() as s:
            s.bind((host, 0))
            return s.getsockname()[1]

    def nccl_connect(self, host: str, port: int, world_size: int) -> None:
        self._nccl = nccl.make_communicator(host, port, 0, world_size)

    def nccl_send(self, specs: list[nccl.Spec], dtype: str) -> None:
        """Broadcast the buckets `specs` (the layout every receiver was given) from rank 0."""
        state = self.model.state_dict()
        with torch.no_grad():
            for spec in specs:
                nccl.send_bucket(self._nccl, {name: state[name].to(DTYPES[dtype]) for name, _ in spec})

    # ---------------------------------------------------------------------------------------------- checkpoints
    def save_checkpoint(self, directory: str, driver_state: dict, keep: int | None = None) -> str:
        """Write the model, optimizer/scheduler state and the driver's state to `directory` (`checkpoint.write`,
        atomically), then keep only the newest `keep` checkpoints beside it (None: all). Returns the directory."""
        state = {"optimizer": self.optimizer.state_dict(), "scheduler": self.scheduler.state_dict(),
                 "optimizer_steps": self.optimizer_steps, "skipped_steps": self.skipped_steps,
                 "consecutive_nonfinite": self._consecutive_nonfinite}
        path = checkpoint.write(directory, self.model, state, driver_state)
        checkpoint.prune(path.parent.parent, keep)  # on this node, where the files are
        return str(path)

    def seen_digest(self, path: str) -> str | None:
        """`checkpoint.seen_digest` on this learner's node, where its checkpoints are written."""
        return checkpoint.seen_digest(path)

    def load_checkpoint(self, directory: str) -> None:
        """Continue from the checkpoint in `directory`: weights, optimizer, scheduler and step counters."""
        checkpoint.load_model(directory, self.model)
        state = checkpoint.load_learner_state(directory)
        self.optimizer.load_state_dict(state["optimizer"])
        self.scheduler.load_state_dict(state["scheduler"])
        self.optimizer_steps, self.skipped_steps = state["optimizer_steps"], state["skipped_steps"]
        self._consecutive_nonfinite = state["consecutive_nonfinite"]
        self.updates = checkpoint.driver_state(Path(directory))["step"]
