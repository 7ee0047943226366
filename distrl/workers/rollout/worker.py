"""Rollout worker: one `vllm.LLM` engine that samples responses and reports the log-probs the sampler used.

Plain class, no Ray. The engine core runs in this process (`VLLM_ENABLE_V1_MULTIPROCESSING=0`), which is what
lets `load_weights` hand tensors straight to `reload_weights` without a restart or a disk round trip.

Log-probs are vLLM's *processed* log-probs (`logprobs_mode="processed_logprobs"`): those of the distribution
actually sampled from, after temperature (and top-k/top-p, when set). The learner divides its logits by the same
temperature; what remains of the difference (dtype, kernels, truncation) is the mismatch `loss.correction` corrects.
"""

from __future__ import annotations

import asyncio
import functools
import multiprocessing.connection
import os
import threading
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, cast

import torch

from distrl.agents.agent import host_of
from distrl.agents.chat import ChatRenderer
from distrl.agents.episode import EnvClient, EpisodeRunner, as_rollouts
from distrl.agents.server import AgentServer
from distrl.agents.tool_calls import ToolCallParser
from distrl.agents.trajectory import Budget
from distrl.config import EnvConfig, EvalSamplingConfig, LoraConfig, ModelConfig, RolloutConfig
from distrl.console import say
from distrl.types.prompt import Prompt
from distrl.types.rollouts import Rollouts
from distrl.workers.device import granted_device
from distrl.workers.rollout import lora_engine, vllm_engine
from distrl.workers.rollout.engine_loop import EngineLoop
from distrl.workers.rollout.engine_weights import EngineWeights
from distrl.workers.rollout.episodes import EngineStepper, Resampled
from distrl.workers.rollout.sampling import eval_sampling, request_seed, sampling_params
from distrl.workers.rollout.slices import continue_samples
from distrl.workers.weights import fingerprint
from distrl.workers.weights.fingerprint import Fingerprint, Held, Region
from distrl.workers.weights.pieces import BucketParts, assemble


class UnusableEngine(RuntimeError):
    """An engine whose last weight load failed midway: it holds part of one version and part of another."""

    def __init__(self, why: str):
        super().__init__(f"this rollout engine cannot serve: {why}; it must be replaced")


async def run_episodes(worker: RolloutWorker, prompts: list[Prompt], groups: list[int], runner: EpisodeRunner,
                       n: int) -> Rollouts:
    """`worker.generate`'s episodes (`n` a prompt, by `runner`), as asyncio tasks on the engine's loop; other calls'
    episodes share the engine. If one episode fails, the call's other episodes are given up (their requests leave
    the engine)."""
    tasks = [asyncio.ensure_future(runner.run(f"{ticket}.{j}", prompt.prompt_ids, prompt.row(),
                                              request_seed(worker.seed, ticket), j))
             for prompt, ticket in zip(prompts, groups, strict=True) for j in range(n)]
    try:
        results = await asyncio.gather(*tasks)
    except BaseException:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        raise
    return as_rollouts(results, groups, n, worker.policy_version)


async def swap_adapters(worker: RolloutWorker, version: int, buckets: Iterable[BucketParts]) -> int:
    """`worker.load_weights` with `learner.lora`, on the engine's loop: drain the engine, put the adapters of
    `version` in its slot (`RolloutWorker._load_adapter`), admit the waiting turns again."""
    worker._check_usable()
    tensors = {name: tensor for bucket in buckets for name, tensor in assemble(bucket).items()}  # megabytes
    await worker.stepper.drain()
    try:
        return worker._load_adapter(version, tensors)
    finally:
        worker.stepper.admit()


def _end_worker(engine: EngineLoop, serving: list[AgentServer]) -> None:
    """Close the agents' endpoint's listening socket, shut the vLLM engine down, then end the engine's loop (all on
    the loop, in order), and wait for it: once a worker is closed, its port refuses connections.

    vLLM's in-process engine core tears down process-wide state (its model-parallel groups) when it shuts down, and
    freezes the garbage collector's view of its objects until then: left to a later collection, that shutdown
    could land under another engine of this process (tests, `distrl eval`) and break it."""
    if engine.loop.is_running():
        for server in serving:
            engine.loop.call_soon_threadsafe(server.stop_listening)
        engine.loop.call_soon_threadsafe(_shut_down, engine.engine)
    engine.stop(wait_s=30.0)


def _shut_down(llm: Any) -> None:
    llm.llm_engine.engine_core.shutdown()  # once: later calls (and vLLM's own finalizer) do nothing


@dataclass
class Served:
    """The policy version an engine serves: read by its stepper at every step, set by a weight load; with
    `learner.lora`, also the `LoRARequest` of its adapters, which every new request carries (None before the first
    push)."""

    version: int = 0
    adapter: Any = None


class RolloutWorker:
    """Generates `n` responses per prompt; `load_weights` swaps the weights in place and bumps `policy_version`.

    With an agent function (`env.agent`) the worker also serves its OpenAI-compatible endpoint
    (`distrl.agents.server`) on the address `address()` gives, in this process (the node's address in a cluster).

    With `lora` (the learners' `learner.lora`) the engine keeps its base weights and serves the pushed adapters
    (`distrl.workers.rollout.lora_engine`): once a version's adapters are loaded, every request carries them.
    """

    def __init__(self, cfg: RolloutConfig, model: ModelConfig, max_prompt_tokens: int, seed: int,
                 num_gpus: float = 0.0, environment: EnvConfig | None = None, envs: EnvClient | None = None,
                 max_restarts: int = 0, address: Callable[[], str] = lambda: "127.0.0.1",
                 max_new_tokens: int | None = None, lora: LoraConfig | None = None, sleep_mode: bool = False,
                 in_process_group: bool = False, exit_when_lost: bool = False):
        LLM = vllm_engine.import_llm()
        self.cfg = cfg
        self.seed = seed
        self.served = Served()
        self._serving: list[AgentServer] = []  # the endpoint, once it listens (closed with the worker)
        self._torn: str | None = None  # why the engine may not serve (see load_weights)
        self.lora = lora
        self.on_gpu = on_gpu = granted_device(num_gpus, "rollout") == "cuda"
        engine_args = vllm_engine.engine_args(cfg, model, max_prompt_tokens, seed, multi_turn=environment is not None,
                                              max_new_tokens=max_new_tokens, lora=lora, on_gpu=on_gpu,
                                              sleep_mode=sleep_mode, in_process_group=in_process_group)
        if in_process_group:  # the external launcher's rank (vllm_engine.engine_args)
            os.environ.update(RANK=str(torch.distributed.get_rank()), LOCAL_RANK="0")
        threads = vllm_engine.worker_threads(cfg)
        if threads is not None and not on_gpu:  # the worker processes vLLM starts read it from the environment
            os.environ["OMP_NUM_THREADS"] = str(threads)
        self.engine = EngineLoop(lambda: LLM(**engine_args))
        # The engine's thread (which holds the engine) ends with the worker, and so does the agents' endpoint.
        self._end = weakref.finalize(self, _end_worker, self.engine, self._serving)
        self.llm = self.engine.engine
        self.engine.call(vllm_engine.warm_up, self.llm)  # before the stepper owns the engine
        self.weights = EngineWeights(self.llm, cfg.tensor_parallel_size, None if lora is None else lora.rank)
        if cfg.tensor_parallel_size > 1:
            self._watch_workers(exit_when_lost)
        self.tokenizer = self.llm.get_tokenizer()
        served, decode = self.served, functools.partial(self.tokenizer.decode, skip_special_tokens=True)
        self.stepper = self.engine.call(EngineStepper, self.llm.llm_engine,
                                        functools.partial(sampling_params, cfg.sampling), lambda: served.version,
                                        decode,  # vLLM's own default for completion text: special tokens skipped
                                        lambda: served.adapter)
        self.engine.start(self.stepper.run())
        budget = Budget.of(cfg.sampling.max_new_tokens, environment, self.llm.llm_engine.model_config.max_model_len)
        hosts = parser = None
        self.endpoint: AgentServer | None = None
        if environment is not None:
            e = environment
            # The environment actors' client, or (unit tests, scripts) this process's own host.
            cls, args = host_of(e)
            hosts = envs or cast(EnvClient, cls(*args))  # the mode decides which of its methods are called
            parser = None if e.tool_parser is None else ToolCallParser(e.tool_parser, self.tokenizer)
            if e.agent is not None:
                self.endpoint = AgentServer()
                self.engine.run(self.endpoint.start(address()))
                self._serving.append(self.endpoint)
        self.runner = EpisodeRunner(self.stepper, ChatRenderer(self.tokenizer), budget, hosts, parser,
                                    self.tokenizer.eos_token_id, max_restarts, self.endpoint)

    def _watch_workers(self, exit_when_lost: bool) -> None:
        """When a worker process of this tensor-parallel engine dies, the engine can serve no more (vLLM then shuts
        its other workers down). With `exit_when_lost` (a Ray actor, which the cluster layer then reports dead and
        replaces like any dead engine) this process ends, so that the driver sees a dead actor and not vLLM's own
        error; otherwise every later call raises UnusableEngine. It ends from a thread that waits on the workers'
        sentinels, and from any call that fails once they are gone: vLLM's executor wakes on the same sentinels
        and fails the calls in flight ("cancelled"), which would otherwise race the watching thread back to the
        driver; and vLLM's answer shuts its executor down, which is not this engine's own shutdown (the run
        stopped on that error in 2 of 10 runs, then 1 of 2, of the killed-worker test before both). (The reverse
        needs nothing: each worker ends when this process does, on vLLM's death pipe.)"""
        executor = self.llm.llm_engine.engine_core.engine_core.model_executor
        sentinels = {w.proc.sentinel: w.proc for w in executor.workers}

        def lost(died: Any) -> None:
            # This engine's own shutdown, not vLLM's answer to a dead worker (which marks the executor failed,
            # then shuts it down: the calls in flight fail, and this process must end all the same).
            if getattr(executor, "shutting_down", False) and not getattr(executor, "is_failed", False):
                return
            self._torn = f"its worker process {died.name} (pid {died.pid}) died, exit code {died.exitcode}"
            if exit_when_lost:
                say(f"rollout engine (pid {os.getpid()}): {self._torn}; ending this process so that the engine is "
                    f"replaced", err=True)
                os._exit(1)

        def call_failed(error: BaseException) -> None:
            ready = multiprocessing.connection.wait(list(sentinels), timeout=0)
            if ready:
                lost(sentinels[ready[0]])

        threading.Thread(target=lambda: lost(sentinels[multiprocessing.connection.wait(list(sentinels))[0]]),
                         name="distrl-engine-workers", daemon=True).start()
        self.engine.on_failure = call_failed

    def worker_pids(self) -> list[int]:
        """The process ids of the engine's workers (this process's at TP 1)."""
        return self.engine.call(self.llm.collective_rpc, "distrl_pid")

    @property
    def policy_version(self) -> int:
        return self.served.version

    def close(self) -> None:
        """Stop listening for agents and end the engine's thread (also done when the worker is collected)."""
        self._end()

    def generate(self, prompts: list[Prompt], groups: list[int],
                 sampling: EvalSamplingConfig | None = None) -> Rollouts:
        """Run `n_samples_per_prompt` episodes per prompt; `groups[i]` is prompt i's ticket (group id), from which
        its requests' seeds are derived. Without an environment an episode is one turn (its reward comes from the
        reward function afterwards); with one, turns alternate with the environment's answers
        (`distrl.agents.episode`). Every episode of the call shares the engine: each engine step advances every
        episode that has a turn to take.

        Returns samples prompt-major: the G episodes of prompts[0], then of prompts[1], ..., each token stamped with
        the policy version that sampled it. With `sampling` (an evaluation's), `sampling.n` episodes a prompt are
        sampled with its settings instead, beside the training episodes in flight.
        """
        self._check_usable()
        runner, n = self.runner, self.cfg.n_samples_per_prompt
        if sampling is not None:
            s = eval_sampling(self.cfg.sampling, sampling)
            runner = runner.resampled(Resampled(self.stepper, functools.partial(sampling_params, s)), s.max_new_tokens)
            n = sampling.n
        # A module function, not a method: Ray runs a class with any coroutine method as an asyncio actor.
        return self.engine.run(run_episodes(self, prompts, groups, runner, n))

    def continue_samples(self, prefixes: Rollouts, samples: list[int], slice_tokens: int) -> Rollouts:
        """Partial rollouts (`loop.partial_rollouts`): one slice of at most `slice_tokens` tokens of each row of
        `prefixes` (sample `samples[i]` of its prompt, continued from the response it has; see
        `distrl.workers.rollout.slices`), all sharing the engine with every other call in flight."""
        self._check_usable()
        seeds = [request_seed(self.seed, ticket) for ticket in prefixes.group]
        return self.engine.run(continue_samples(self.stepper, self.runner.budget, prefixes, samples, seeds,
                                                slice_tokens,
                                                functools.partial(self.tokenizer.decode, skip_special_tokens=True)))

    def version(self) -> int:
        """The policy version this engine serves."""
        return self.policy_version

    def sleep(self, level: int) -> None:
        """Release the engine's GPU memory (built with `sleep_mode`): level 1 moves the weights to CPU memory and drops
        the KV cache, level 2 drops both. Nothing may generate until `wake_up`."""
        self.engine.call(self.llm.sleep, level=level)

    def wake_up(self, tags: list[str]) -> None:
        """Take back the GPU memory of `tags` ("weights", "kv_cache") that `sleep` released."""
        self.engine.call(self.llm.wake_up, tags=tags)

    def load_weights(self, version: int, buckets: Iterable[BucketParts]) -> int:
        """Replace the engine's weights in place with HF-named tensors, bucket by bucket, in every worker of the
        engine (`EngineWeights.load`); returns the new version. Each bucket is the learners' pieces of it.

        `buckets` is consumed as the reload reaches each bucket (an iterable that fetches or receives a bucket only
        when asked keeps one bucket here at a time, not a copy of the model), and each tensor is let go once loaded.
        vLLM's layer-wise reload holds a layer's tensors until all of them are in (a fused qkv or gate_up
        projection may span two buckets), then processes the layer (on CPU: repacks it for oneDNN). The engine
        serves `version` only once every bucket is in; a load that fails midway leaves a mix of two versions, so
        the engine refuses all further work (`UnusableEngine`) and must be replaced.

        Runs on the engine's thread between two engine steps: turns in flight go on with the new weights from the
        next step (their cached keys and values are computed again), each token stamped with the version that
        sampled it.

        With `learner.lora` the buckets hold adapters, which a vLLM request cannot change once added: the engine is
        drained instead (turns in flight finish with the adapters they started with, stamped with their version; new
        turns wait), then the new version's adapters replace them (`_load_adapter`)."""
        if self.lora is not None:
            # A module function, not a method: Ray runs a class with any coroutine method as an asyncio actor.
            return self.engine.run(swap_adapters(self, version, buckets))
        return self.engine.call(self._load_weights, version, buckets)

    def _load_weights(self, version: int, buckets: Iterable[BucketParts]) -> int:
        self._check_usable()
        loaded = False
        try:
            self.weights.load(buckets)
            loaded = True
        finally:
            if not loaded:
                self._torn = (f"loading the weights of version {version} failed midway: it serves a mix of two "
                              f"versions' weights")
        # Cached KV blocks were computed with the old weights; so were those of turns in flight.
        self.llm.reset_prefix_cache(reset_running_requests=self.stepper.in_flight > 0)
        self.served.version = version
        return version

    def _load_adapter(self, version: int, tensors: dict[str, torch.Tensor]) -> int:
        """The adapter tensors (PEFT names) become the adapters of `version` in the engine's slot, in place of the
        previous version's, and every request from now on carries them. The engine is drained: no request still
        carries the previous version's, which are removed."""
        from distrl.workers.training.lora import peft_config

        assert self.lora is not None and self.stepper.in_flight == 0
        previous = self.policy_version if self.served.adapter is not None else None
        self.weights.register_adapters(version, tensors, peft_config(self.lora), previous)
        self.served.adapter = lora_engine.request_for(version)
        self.llm.reset_prefix_cache()  # blocks cached under the previous version's name can no longer be asked for
        self.served.version = version
        return version

    def _check_usable(self) -> None:
        if self._torn is not None:
            raise UnusableEngine(self._torn)

    def worker_regions(self) -> list[Held]:
        """Each worker's regions of the tensors it holds (its layout), (name, region) each, in worker order."""
        return self.engine.call(self.weights.regions)

    def weight_regions(self) -> dict[str, list[Region]]:
        """Every region of the weights (HF names; PEFT names with `learner.lora`) that some worker of this engine
        holds: what the learners fingerprint for `check_weights`."""
        return self.engine.call(self.weights.union_of_regions)

    def check_weights(self, version: int, name: str, *expected: Fingerprint) -> int:
        """Compare the weights each worker of this engine (actor `name`) serves with the learners' fingerprint of
        version `version` (the push's load, resolved first), which is the sum of `expected`, one part per learner
        (`fingerprint.add`); returns `version`. Raises WeightMismatch naming the engine, the worker and the first
        tensor that differs."""
        self._check_usable()
        adapter = self.served.adapter
        serving = None if adapter is None or adapter.lora_int_id != lora_engine.lora_id(version) else version
        self.engine.call(self.weights.check, fingerprint.add(expected), name, version, serving)
        return version

    def nccl_connect(self, host: str, port: int, rank: int, world_size: int, timeout_s: float) -> None:
        """Join the NCCL weight-sync world: this engine's workers as ranks `rank` to `rank + k - 1` (k its
        tensor-parallel size; `nccl.make_communicator` in each), waiting `timeout_s` for the other ranks; a
        communicator of an earlier world is dropped."""
        self.engine.call(self.llm.collective_rpc, "distrl_nccl_connect", args=(host, port, rank, world_size,
                                                                               timeout_s))

    def nccl_receive(self, version: int, specs: list, dtype: str) -> int:
        """Load the buckets learner 0 broadcasts (see `distrl.workers.weights.nccl`) in place, in every worker, each
        received only when the reload reaches it: one bucket on each device at a time, not a copy of the model
        outside vLLM's budget."""
        return self.engine.call(self._nccl_receive, version, specs, dtype)

    def _nccl_receive(self, version: int, specs: list, dtype: str) -> int:
        self._check_usable()
        loaded = False
        try:
            self.llm.collective_rpc("distrl_nccl_receive", args=(specs, dtype))
            loaded = True
        finally:
            if not loaded:
                self._torn = (f"receiving the weights of version {version} failed midway: it serves a mix of two "
                              f"versions' weights")
        self.llm.reset_prefix_cache(reset_running_requests=self.stepper.in_flight > 0)
        self.served.version = version
        return version

    def score(self, sequences: list[list[int]], prompt_len: int) -> list[list[float]]:
        """Log-probs the engine assigns to the tokens after position `prompt_len` of each sequence (no sampling).

        Used to check that the engine serves exactly the learner's weights after a sync. Raw log-probs:
        vLLM applies no temperature to prompt log-probs. Only while no generation is in flight (it steps the engine
        itself).
        """
        self._check_usable()
        return self.engine.call(self._score, sequences, prompt_len)

    def _score(self, sequences: list[list[int]], prompt_len: int) -> list[list[float]]:
        from vllm import SamplingParams
        from vllm.inputs import TokensPrompt

        if self.stepper.in_flight:
            raise RuntimeError("RolloutWorker.score steps the engine itself: call it while no generation runs")
        params = SamplingParams(max_tokens=1, prompt_logprobs=0, temperature=1.0)
        outputs = self.llm.generate([TokensPrompt(prompt_token_ids=list(s)) for s in sequences], params,
                                    use_tqdm=False, lora_request=self.served.adapter)
        return [[step[tok].logprob
                 for tok, step in zip(seq[prompt_len:], out.prompt_logprobs[prompt_len:], strict=True)]
                for seq, out in zip(sequences, outputs, strict=True)]
