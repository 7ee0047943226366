"""The bwrap sandbox and the python tool, for real: what the code may not see or do, and each limit stopping it.

Each test runs real sandboxes with limits of a few seconds and its own pytest timeout, so a broken limit fails
the test instead of hanging the suite."""

from __future__ import annotations

import ast
import asyncio
import os
import socket
import sys
import time
import uuid
from pathlib import Path

import pytest

import distrl
from distrl.agents.sandbox import Sandbox, SandboxLimits, SandboxUnavailable
from distrl.agents.tools.python import PythonTool

pytestmark = pytest.mark.timeout(60)


@pytest.fixture(scope="module")
def tool() -> PythonTool:
    return PythonTool(timeout_s=3.0, cpu_s=10, memory_bytes=512 << 20, max_output_bytes=8192, max_processes=16,
                      max_output_chars=2000)


def run(tool: PythonTool, code: str):
    return asyncio.run(tool.call({"code": code}))


def alive_with(marker: str) -> list[int]:
    """Pids of live processes whose command line holds `marker` (the sandboxed code travels in argv)."""
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if marker.encode() in (entry / "cmdline").read_bytes():
                    pids.append(int(entry.name))
            except OSError:  # the process ended while we looked
                continue
    return pids


def assert_all_gone(marker: str) -> None:
    deadline = time.monotonic() + 5
    while alive_with(marker) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert alive_with(marker) == []


def test_print(tool):
    start = time.monotonic()
    assert run(tool, "print(2 + 3)").content == "5\n"
    assert time.monotonic() - start < 2


def test_no_network_not_even_the_hosts_loopback(tool):
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        server.settimeout(0.5)
        port = server.getsockname()[1]
        result = run(tool, f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=2)\nprint('in')")
        with pytest.raises(TimeoutError):  # nothing reached the host's listener
            server.accept()
    assert result.error == "runtime_error"
    assert "ConnectionRefusedError" in result.content or "Network is unreachable" in result.content


def test_writes_only_under_tmp(tool):
    result = run(tool, "import os\n"
                       "for path in ('/usr/planted', '/planted', os.path.dirname(os.__file__) + '/planted'):\n"
                       "    try:\n        open(path, 'w')\n        print('wrote', path)\n"
                       "    except OSError as err:\n        print('refused', err.errno)\n"
                       "open('/tmp/scratch', 'w').write('kept')\nprint(open('/tmp/scratch').read())")
    assert result.error is None
    assert "wrote" not in result.content
    assert result.content.count("refused") == 3
    assert result.content.endswith("kept\n")


def test_sees_no_host_files_environment_or_home(tool, tmp_path, monkeypatch):
    secret = tmp_path / "token"
    secret.write_text("hunter2")
    monkeypatch.setenv("DISTRL_TEST_SECRET", "hunter2")
    home, project = str(Path.home()), str(Path(distrl.__file__).resolve().parent.parent)
    result = run(tool, f"import os\n"
                       f"print(os.path.exists({str(secret)!r}), os.path.exists({project!r}))\n"
                       f"print(sorted(os.listdir({home!r})) if os.path.isdir({home!r}) else [])\n"
                       f"print(sorted(os.environ))\nprint(sorted(os.listdir('/')))")
    assert result.error is None, result.content
    exists, home_entries, env, top = result.content.splitlines()
    assert exists == "False False"
    # The home directory shows at most the path down to the interpreter (pyenv keeps Python under /root).
    interpreter = os.path.realpath(sys.base_prefix)
    assert all(interpreter.startswith(os.path.join(home, entry) + os.sep) for entry in ast.literal_eval(home_entries))
    assert ast.literal_eval(env) == ["HOME", "LANG", "PATH", "PWD"]
    assert "hunter2" not in result.content
    assert not {"home", "work", "etc/ssh", "var", "run", "opt", "srv", "mnt"} & set(ast.literal_eval(top))


def test_infinite_loop_times_out(tool):
    marker = uuid.uuid4().hex
    result = run(tool, f"# {marker}\nwhile True:\n    pass")
    assert result.error == "timeout"
    assert "longer than 3 s" in result.content
    assert_all_gone(marker)


def test_cpu_limit():
    result = asyncio.run(PythonTool(timeout_s=20, cpu_s=1).call({"code": "while True:\n    pass"}))
    assert result.error == "cpu_limit"


def test_runaway_output_is_cut(tool):
    marker = uuid.uuid4().hex
    result = run(tool, f"# {marker}\nwhile True:\n    print('x' * 1000)")
    assert result.error == "output_limit"
    assert "[truncated: showing the first 2000 of 8192 characters]" in result.content
    assert result.content.endswith("[stopped: the program printed more than 8192 bytes]")
    assert_all_gone(marker)


def test_memory_hog_fails(tool):
    result = run(tool, "x = bytearray(2 << 30)\nprint('allocated')")
    assert result.error == "runtime_error"
    assert "MemoryError" in result.content
    assert "allocated" not in result.content


def test_fork_bomb_is_bounded_and_cleaned_up(tool):
    marker = uuid.uuid4().hex
    counted = run(tool, f"# {marker}\nimport os, time\nn = 0\nwhile True:\n    try:\n        pid = os.fork()\n"
                        f"    except OSError:\n        break\n    if pid == 0:\n        time.sleep(30)\n"
                        f"        os._exit(0)\n    n += 1\nprint(n)")
    assert counted.error is None, counted.content
    assert 1 <= int(counted.content) < 16  # RLIMIT_NPROC: 16 tasks, this process one of them
    start = time.monotonic()
    bomb = run(tool, f"# {marker}\nimport os\nwhile True:\n    try:\n        os.fork()\n    except OSError:\n"
                     f"        pass")
    assert bomb.error == "timeout"
    assert time.monotonic() - start < 10
    assert_all_gone(marker)  # the sleeping children of the first run too: the PID namespace took them
    assert run(tool, "print('after')").content == "after\n"


def test_runs_do_not_block_each_other(tool):
    async def both():
        return await asyncio.gather(tool.call({"code": "import time; time.sleep(1.5)"}),
                                    tool.call({"code": "import time; time.sleep(1.5)"}))

    start = time.monotonic()
    results = asyncio.run(both())
    assert [r.error for r in results] == [None, None]
    assert time.monotonic() - start < 2.9


def test_cancelled_call_leaves_no_process(tool):
    marker = uuid.uuid4().hex

    async def cancel():
        task = asyncio.ensure_future(tool.call({"code": f"# {marker}\nimport time\ntime.sleep(30)"}))
        await asyncio.sleep(0.5)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(cancel())
    assert_all_gone(marker)


@pytest.mark.parametrize("arguments", [{}, {"code": 1}, {"code": "print(1)", "x": 1}, {"code": "#" * (65 << 10)}])
def test_bad_arguments(tool, arguments):
    assert run_args(tool, arguments).error == "bad_arguments"


def run_args(tool, arguments):
    return asyncio.run(tool.call(arguments))


def test_exception_shows_the_traceback(tool):
    result = run(tool, "raise ValueError('no')")
    assert result.error == "runtime_error"
    assert "ValueError: no" in result.content
    assert result.content.endswith("[exit status 1]")


def test_no_working_bwrap_is_an_error_not_an_unsandboxed_run(tmp_path):
    with pytest.raises(SandboxUnavailable, match="/nonexistent/bwrap") as err:
        Sandbox(SandboxLimits(), bwrap="/nonexistent/bwrap")
    assert "never run unsandboxed" in str(err.value)
    with pytest.raises(SandboxUnavailable, match="/bin/false: exit status 1"):
        Sandbox(SandboxLimits(), bwrap="/bin/false")


def test_limits_must_be_positive():
    with pytest.raises(ValueError, match=r"SandboxLimits.timeout_s must be positive"):
        SandboxLimits(timeout_s=0)
