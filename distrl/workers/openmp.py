"""`release_threads`: end the OpenMP worker threads that the calling thread's parallel regions started.

Why a hybrid actor needs it: libgomp (torch's OpenMP runtime) keeps a pool of worker threads for every thread that
has started a parallel region, for as long as that thread lives, and counts the workers of all pools. Once the count
passes the CPUs the process may use, a worker waiting for the next region spins about 100 times instead of about
300,000 before it sleeps on a futex, so every region pays for waking its workers. A hybrid actor computes on two
threads: the actor's (learner, reference) and the engine's (vLLM). With OMP_NUM_THREADS at the CPU count their two
pools throttle each other: on 2 cores a tiny-model forward and backward made ~560 context switches instead of none
and took 0.08-0.09 s instead of 0.07 s, and generation 0.11-0.14 s instead of 0.08-0.10 s. Ending the pool of the
thread whose turn is over (omp_pause_resource_all, OpenMP 5.0) leaves one pool, and the next region on that thread
starts its workers again (one thread creation per worker).
"""

from __future__ import annotations

import ctypes
import functools

import torch

OMP_PAUSE_HARD = 2
"""`omp_pause_hard` of omp.h's `omp_pause_resource_t`: the runtime's threads end."""


@functools.cache
def runtime() -> ctypes.CDLL | None:
    """torch's OpenMP runtime, or None where torch has none (or one older than OpenMP 5.0's pause).

    Looked up through torch's extension, whose dependencies are searched in the order torch's own calls bind to:
    a process may hold several copies of libgomp (sentencepiece bundles one), and only torch's pool matters."""
    library = ctypes.CDLL(torch._C.__file__)  # already loaded: the same handle
    return library if hasattr(library, "omp_pause_resource_all") else None


def release_threads() -> bool:
    """End the worker threads of the calling thread's OpenMP pool (none to end is fine); False where there is no
    runtime to ask, or when called inside a parallel region."""
    library = runtime()
    return library is not None and library.omp_pause_resource_all(OMP_PAUSE_HARD) == 0
