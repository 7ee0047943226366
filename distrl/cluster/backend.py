"""Where the workers run: `RayBackend` (actors on a Ray cluster) or `LocalBackend` (instances in the driver's
process). `cluster.backend` picks one; the driver sees only this interface, so its loop cannot tell them apart.

`RayBackend` connects to Ray for the length of a run: an embedded local cluster of its own by default (every server
on 127.0.0.1, the dashboard too unless `cluster.dashboard_host` says otherwise, token auth on: `loopback_cluster`),
or an existing one (a Ray job, `cluster.address`, `RAY_ADDRESS`). `close()` shuts down only what it started; an
embedded cluster whose driver dies without `close()` (SIGKILL) is ended by `distrl.cluster.reaper`.

The floor of `distrl.cluster`: it starts workers (`actors`) and resolves their handles, and imports no cluster
module but the reaper and the library log (`distrl.cluster.library_log`). Groups (`distrl.cluster.group`) wrap the
workers it starts; placements (`distrl.cluster.placement`) are made beside it.
"""

from __future__ import annotations

import logging
import os
import secrets
import shutil
import subprocess
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from contextlib import ExitStack, contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from distrl.cluster import reaper
from distrl.cluster.library_log import forwarded_lines
from distrl.config import ClusterConfig, RoleResources
from distrl.console import IN_ACTOR

Init = Callable[[int], tuple[tuple, dict]]
"""`init(i)` gives worker i's constructor (args, kwargs)."""

Make = Callable[[int, int], Any]
"""`make(i, incarnation)` starts worker i (a Ray actor handle, or a worker instance) and returns it."""


class ActorLost(RuntimeError):
    """A worker's process is gone (killed, out of memory, its node lost); Ray reports it as `RayActorError`. Fakes
    in tests raise it to stand for that."""


@dataclass(eq=False)  # compared and hashed by identity, like a Ray ObjectRef
class Done:
    """A local call's outcome, already there: its value, or the exception it raised (raised again by `get`)."""

    value: Any = None
    error: BaseException | None = None


class Backend(ABC):
    description: str

    @abstractmethod
    def actors(self, worker: type, role: str, resources: RoleResources, *, run_name: str, init: Init,
               env: dict[str, str], scheduling: Callable[[int], Any] | None, concurrency: int = 1,
               self_restarts: int = 0) -> Make:
        """How to start worker i of `role` (and its replacements) as a `worker` with `resources`: `make(i,
        incarnation)`. `scheduling(i)` is Ray's scheduling strategy for worker i (its placement bundle: see
        `distrl.cluster.placement`), None where nothing is placed. `concurrency`: calls a Ray actor runs at once
        (an asyncio actor's coroutines); `self_restarts`: times Ray itself restarts a dead actor in place."""

    @abstractmethod
    def task(self, fn: Callable, *args: Any, num_cpus: float, max_retries: int = 0) -> Any:
        """Run the plain function `fn(*args)` as a task; returns its handle. A task whose process dies (killed,
        node lost) is run again up to `max_retries` times; an exception that `fn` raises is never retried."""

    @abstractmethod
    def get(self, handles: Any, timeout: float | None = None) -> Any:
        """The value of a handle, or the list of values of a list of handles; raises what the call raised, or
        TimeoutError when `timeout` seconds pass first."""

    def answer(self, handles: Any, what: str, timeout_s: float, setting: str = "cluster.call_timeout_s") -> Any:
        """`get(handles)`, or a TimeoutError naming `what` (the calls) and `setting` (their limit) if they have not
        all returned within `timeout_s`."""
        try:
            return self.get(handles, timeout=timeout_s)
        except TimeoutError as err:
            raise TimeoutError(f"{what} has not returned within {setting} = {timeout_s:g} s") from err

    @abstractmethod
    def wait(self, handles: Sequence[Any], timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        """(handles that are done, the others) once at least one is done or `timeout` seconds have passed."""

    @abstractmethod
    def lost(self, error: BaseException) -> bool:
        """Whether `error`, raised by `get`, means the worker's process is gone (rather than that the call raised)."""

    def unreachable(self, error: BaseException) -> bool:
        """Whether `error`, one that `lost` accepts, says only that the worker cannot be reached now: its node may be
        lost, which the cluster has not declared yet, or cut off for a while."""
        return False

    @abstractmethod
    def close(self) -> None:
        """Release what the backend itself started."""


class LocalBackend(Backend):
    description = "local backend: every worker in this process (no Ray)"

    def actors(self, worker: type, role: str, resources: RoleResources, *, run_name: str, init: Init,
               env: dict[str, str], scheduling: Callable[[int], Any] | None, concurrency: int = 1,
               self_restarts: int = 0) -> Make:
        def make(i: int, incarnation: int) -> Any:
            args, kwargs = init(i)
            return worker(*args, **kwargs)

        return make

    def task(self, fn: Callable, *args: Any, num_cpus: float, max_retries: int = 0) -> Done:
        try:
            return Done(fn(*args))
        except Exception as err:  # noqa: BLE001 - handed back like a Ray task error, raised by `get`
            return Done(error=err)

    def get(self, handles: Any, timeout: float | None = None) -> Any:  # local calls are done: nothing to wait for
        if isinstance(handles, list):
            return [self.get(h) for h in handles]
        if handles.error is not None:
            raise handles.error
        return handles.value

    def wait(self, handles: Sequence[Any], timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        return list(handles), []

    def lost(self, error: BaseException) -> bool:
        return isinstance(error, ActorLost)

    def close(self) -> None:
        pass  # nothing was started


class RayBackend(Backend):
    """`library_log`: where the libraries' lines that Ray forwards from the actors go while the backend is open
    (`distrl.cluster.library_log`; None: the console)."""

    def __init__(self, cfg: ClusterConfig, library_log: Path | None = None):
        import ray

        address = cfg.address or os.environ.get("RAY_ADDRESS")
        self.owned = not ray.is_initialized()
        self.embedded = False  # an embedded cluster of this run's own: this machine alone
        self._remote_fns: dict[Callable, Any] = {}
        self._reaper: subprocess.Popen | None = None
        self._embedded = ExitStack()
        if not self.owned:
            self.description = "ray: using the session already initialised in this process"
        elif address:
            ray.init(address=address)
            self.description = f"ray: joined {address}"
        else:
            # address="local": a new cluster of our own even when `ray start` left one running on this machine
            # (without it Ray joins that one and refuses num_cpus).
            with ExitStack() as embedded:  # undone at once if ray.init fails, else at close()
                token = embedded.enter_context(loopback_cluster())
                # Ray's notice of the local instance it started says what `description` says.
                ctx = ray.init(address="local", num_cpus=cfg.num_cpus, include_dashboard=True,
                               dashboard_host=cfg.dashboard_host, _node_ip_address="127.0.0.1",
                               logging_level=logging.INFO if library_log is None else logging.WARNING)
                self._embedded = embedded.pop_all()
            self.embedded = True
            # Ends Ray's agents if this process dies without shutting the cluster down (SIGKILL, OOM killer).
            self._reaper = reaper.start(os.getpid(), [str(token.parent)] if token else [])
            self.description = (f"ray: embedded cluster on 127.0.0.1, dashboard at "
                                f"http://{ctx.dashboard_url or 'unavailable'}"
                                + (f" (its token is in {token} while the run lasts)" if token else ""))
        self._lines = ExitStack()
        self._lines.enter_context(forwarded_lines(library_log))

    def actors(self, worker: type, role: str, resources: RoleResources, *, run_name: str, init: Init,
               env: dict[str, str], scheduling: Callable[[int], Any] | None, concurrency: int = 1,
               self_restarts: int = 0) -> Make:
        import ray

        assert scheduling is not None, "RayBackend.actors needs the role's placement (distrl.cluster.placement.place)"
        remote_cls: Any = ray.remote(worker)

        def make(i: int, incarnation: int) -> Any:
            args, kwargs = init(i)
            # A replacement gets a name of its own: the dead actor's may not be released yet.
            suffix = f".{incarnation}" if incarnation else ""
            return remote_cls.options(
                name=f"distrl/{run_name}/{role}-{i}{suffix}",
                num_cpus=resources.num_cpus,
                num_gpus=resources.num_gpus,
                runtime_env={"env_vars": {**env, IN_ACTOR: "1"}},  # its own lines marked for the driver
                scheduling_strategy=scheduling(i),
                # By default one call at a time, in submission order: a weight push queues behind an in-flight
                # generate.
                max_concurrency=concurrency,
                max_restarts=self_restarts,
            ).remote(*args, **kwargs)

        return make

    def task(self, fn: Callable, *args: Any, num_cpus: float, max_retries: int = 0) -> Any:
        import ray

        if fn not in self._remote_fns:
            self._remote_fns[fn] = ray.remote(fn)
        # Ray retries a task on system failures only (its worker died) unless retry_exceptions is set.
        return self._remote_fns[fn].options(num_cpus=num_cpus, max_retries=max_retries,
                                            retry_exceptions=False).remote(*args)

    def get(self, handles: Any, timeout: float | None = None) -> Any:
        import ray

        return ray.get(handles, timeout=timeout)  # GetTimeoutError is a TimeoutError

    def wait(self, handles: Sequence[Any], timeout: float | None = None) -> tuple[list[Any], list[Any]]:
        import ray

        return ray.wait(list(handles), num_returns=1, timeout=timeout)

    def lost(self, error: BaseException) -> bool:
        from ray.exceptions import ObjectLostError, RayActorError, RayTaskError

        # RayActorError: the actor died (ActorDiedError) or cannot be reached (ActorUnavailableError); ObjectLostError:
        # its result was stored on a node since lost (with it). An exception raised by the method itself arrives as
        # RayTaskError, which Ray makes an instance of its cause's class too: an engine whose weight load could not
        # fetch learner 0's buckets (that learner's node lost) raises a RayTaskError that is also an
        # ObjectLostError, and is not the engine's loss.
        return isinstance(error, RayActorError | ObjectLostError | ActorLost) and not isinstance(error, RayTaskError)

    def unreachable(self, error: BaseException) -> bool:
        from ray.exceptions import ActorUnavailableError, ObjectLostError, RayTaskError

        # Ray raises these at once when a call's actor cannot be reached (its raylet is gone, or the network), or its
        # result was on a node that is gone; its GCS declares the node dead only once the node's health checks have
        # failed (about 15 s with Ray's defaults). Not when the method itself raised them (`lost`).
        return isinstance(error, ActorUnavailableError | ObjectLostError) and not isinstance(error, RayTaskError)

    def close(self) -> None:
        import ray

        if self.owned and ray.is_initialized():
            ray.shutdown()
        self._lines.close()  # after the shutdown: the actors' last lines (a final checkpoint's) go to the log too
        self._embedded.close()
        if self._reaper is not None:
            self._reaper.terminate()
            self._reaper.wait(timeout=10)
            self._reaper = None


@contextmanager
def loopback_cluster() -> Iterator[Path | None]:
    """Settings for an embedded cluster reachable from this machine only, behind a token that nothing keeps after
    the run; undone on exit. Yields the token's file if the run made one (None: the user's own token is used).

    - Ray turns a loopback node IP into the host's address (`resolve_ip_for_localhost`); its agents and metrics
      exports then listen on that address or on every interface, and its gRPC servers on every interface. In its
      single-machine mode (the one it runs on macOS and Windows) the node IP stays 127.0.0.1 and every server
      listens there. Ray reads the switch when it is imported: the variable tells the processes the cluster starts,
      the constant the Ray already imported here.
    - `ray.init` turns token auth on and, when the user has no token, writes one to ~/.ray/auth_token, where it
      outlives the run. Unless a token is set (RAY_AUTH_TOKEN, RAY_AUTH_TOKEN_PATH, ~/.ray/auth_token), the run
      makes its own in a private temporary directory, removed with the cluster."""
    from ray._private import ray_constants
    from ray._raylet import AuthenticationTokenLoader  # type: ignore[attr-defined]  # compiled; the stub omits it

    # ray.init sets RAY_AUTH_MODE; Ray's token loader caches the token it read first, so it is reloaded both ways.
    saved_env = {k: os.environ.get(k) for k in ("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "RAY_AUTH_TOKEN_PATH",
                                                "RAY_AUTH_MODE")}
    saved_switch = ray_constants.ENABLE_RAY_CLUSTER
    os.environ["RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"] = "0"
    ray_constants.ENABLE_RAY_CLUSTER = False
    directory = None
    if not (os.environ.get("RAY_AUTH_TOKEN") or os.environ.get("RAY_AUTH_TOKEN_PATH")
            or (Path.home() / ".ray" / "auth_token").is_file()):
        directory = tempfile.mkdtemp(prefix="distrl-ray-token-")  # mode 0700
        token = Path(directory) / "auth_token"
        token.touch(mode=0o600)
        token.write_text(secrets.token_hex(32))
        os.environ["RAY_AUTH_TOKEN_PATH"] = str(token)
    AuthenticationTokenLoader.instance().reset_cache()
    # Ray warns at its start that it turned token auth on, and how to opt out: here it is the run's choice. (Setting
    # RAY_AUTH_MODE=token instead skips the part of ray.init that turns it on in the Ray already imported.)
    notice = logging.getLogger("ray._private.authentication.authentication_token_setup")
    notice.addFilter(_token_auth_chosen)
    try:
        yield Path(directory) / "auth_token" if directory else None
    finally:
        notice.removeFilter(_token_auth_chosen)
        ray_constants.ENABLE_RAY_CLUSTER = saved_switch
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        if directory:
            shutil.rmtree(directory, ignore_errors=True)
        AuthenticationTokenLoader.instance().reset_cache()


def _token_auth_chosen(record: logging.LogRecord) -> bool:
    return not record.getMessage().startswith("Token authentication is enabled for this Ray cluster")


def connect(cfg: ClusterConfig, library_log: Path | None = None) -> Backend:
    """The backend `cluster.backend` names, connected (`library_log`: `RayBackend`'s)."""
    return LocalBackend() if cfg.backend == "local" else RayBackend(cfg, library_log)
