"""`PythonTool`: runs the model's Python code in a `Sandbox` and returns what it printed.

The content is stdout and stderr interleaved (a traceback included), cut to `max_output_chars`; on failure a last
line says what happened. Error kinds: "bad_arguments", "timeout", "output_limit", "runtime_error" (a non-zero exit
status or a signal: an exception, a MemoryError from the memory limit, a refused fork), "cpu_limit".
"""

from __future__ import annotations

import signal

from distrl.agents.sandbox import Sandbox, SandboxLimits, SandboxResult
from distrl.agents.tools.base import DEFAULT_MAX_OUTPUT_CHARS, ToolResult, truncate

__all__ = ["MAX_CODE_BYTES", "PythonTool"]

MAX_CODE_BYTES = 64 * 1024
"""Largest program accepted: it travels as one command-line argument, which Linux caps at 128 KiB."""


class PythonTool:
    """Runs `{"code": "print(2 + 3)"}` -> "5\\n" in a fresh sandbox per call (no state carries over between calls)."""

    name = "python"

    def __init__(self, timeout_s: float = 10.0, cpu_s: int = 10, memory_bytes: int = 1 << 30,
                 max_output_bytes: int = 64 * 1024, max_processes: int = 32,
                 max_output_chars: int = DEFAULT_MAX_OUTPUT_CHARS, bwrap: str | None = None) -> None:
        """Raises `SandboxUnavailable` when this host cannot sandbox code (the code would never run unsandboxed)."""
        self.limits = SandboxLimits(timeout_s=timeout_s, cpu_s=cpu_s, memory_bytes=memory_bytes,
                                    max_output_bytes=max_output_bytes, max_processes=max_processes)
        self.max_output_chars = max_output_chars
        self.sandbox = Sandbox(self.limits, bwrap=bwrap)

    def schema(self) -> dict:
        lim = self.limits
        return {"type": "function", "function": {
            "name": self.name,
            "description": f"Run a Python 3 program (standard library only) and return what it prints to stdout and "
                           f"stderr. Use print() to see results. Each call starts fresh; there is no network; files "
                           f"can be written only under /tmp. Limits: {lim.timeout_s:g} s, "
                           f"{lim.memory_bytes >> 20} MiB of memory, {self.max_output_chars} characters of output.",
            "parameters": {"type": "object", "properties": {
                "code": {"type": "string", "description": "The complete program to run."}},
                "required": ["code"]}}}

    async def call(self, arguments: dict) -> ToolResult:
        code = arguments.get("code") if isinstance(arguments, dict) else None
        if not isinstance(code, str) or set(arguments) != {"code"}:
            return ToolResult("python takes exactly one argument, \"code\" (a string); got "
                              f"{truncate(repr(arguments), 200)[0]}", error="bad_arguments")
        if len(code.encode()) > MAX_CODE_BYTES or "\0" in code:
            return ToolResult(f"the code must be at most {MAX_CODE_BYTES} bytes and contain no NUL character",
                              error="bad_arguments")
        return self._result(await self.sandbox.run(code))

    def _result(self, run: SandboxResult) -> ToolResult:
        error, note = _outcome(run, self.limits)
        content, _ = truncate(run.output, self.max_output_chars)
        if note:
            content = f"{content}\n[{note}]" if content else f"[{note}]"
        return ToolResult(content, error=error)


def _outcome(run: SandboxResult, limits: SandboxLimits) -> tuple[str | None, str | None]:
    """(error kind, a note for the model) of a sandbox run; (None, None) for a clean exit."""
    if run.stopped_by == "timeout":
        return "timeout", f"stopped: the program ran longer than {limits.timeout_s:g} s"
    if run.stopped_by == "output_limit":
        return "output_limit", f"stopped: the program printed more than {limits.max_output_bytes} bytes"
    sig = _signal_of(run.returncode)
    if sig == signal.SIGXCPU:  # RLIMIT_CPU's soft limit
        return "cpu_limit", f"stopped by SIGXCPU: the program used more than {limits.cpu_s} s of CPU"
    if sig is not None:
        return "runtime_error", f"killed by {sig.name}"
    if run.returncode:
        return "runtime_error", f"exit status {run.returncode}"
    return None, None


def _signal_of(returncode: int | None) -> signal.Signals | None:
    """The signal that ended the program: bwrap exits 128 + N when its command dies of signal N (so a program's own
    `sys.exit(130)` reads as SIGINT too); a negative status is bwrap's own death."""
    if returncode is None or 0 <= returncode <= 128:
        return None
    number = -returncode if returncode < 0 else returncode - 128
    return signal.Signals(number) if number in signal.valid_signals() else None
