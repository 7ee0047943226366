"""A bucket in shared memory (`distrl.workers.rollout.shared_bucket`): written once by the rollout actor, read by
other processes (a tensor-parallel engine's workers) through a few hundred bytes of description, and gone once the
writer has closed it and no reader holds a view of it."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import torch

from distrl.workers.rollout.shared_bucket import ALIGN, SharedMemory, allocate
from distrl.workers.weights.export import Bucket
from distrl.workers.weights.pieces import BucketParts, Pieces, assemble


def read_in_child(bucket, out) -> None:
    """A worker process: the tensors' values and whether each view is read-only shared memory, not a copy."""
    out.put({name: (t.tolist(), t.dtype == torch.bfloat16) for name, t in bucket.items()})


def test_a_bucket_written_once_is_read_by_another_process_from_a_small_description():
    spec = [("a.weight", (2, 3)), ("b.bias", (3,))]
    memory = SharedMemory(spec, torch.bfloat16)
    memory.tensors["a.weight"].copy_(torch.arange(6.0).reshape(2, 3))
    memory.tensors["b.bias"].copy_(torch.tensor([-1.0, 0.5, 2.0]))
    assert [offset % ALIGN for *_, offset in memory.bucket.entries] == [0, 0]
    assert len(pickle.dumps(memory.bucket)) < 400  # what vLLM's RPC carries to each worker: no tensor bytes

    context = mp.get_context("spawn")  # as vLLM starts its workers
    out = context.Queue()
    child = context.Process(target=read_in_child, args=(memory.bucket, out))
    child.start()
    seen = out.get(timeout=120)
    child.join(timeout=60)
    assert seen == {"a.weight": ([[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], True), "b.bias": ([-1.0, 0.5, 2.0], True)}

    fd_path = f"/proc/{os.getpid()}/fd/{memory.fd}"
    assert "memfd:distrl-weights" in os.readlink(fd_path)
    memory.close()
    assert not os.path.exists(fd_path) or "memfd:distrl-weights" not in os.readlink(fd_path)


def test_the_learners_pieces_are_assembled_straight_into_shared_memory():
    opened: list[SharedMemory] = []
    full = torch.arange(8.0).reshape(4, 2)
    bucket = BucketParts([("w", (4, 2))], [Pieces(Bucket(w=full[:3]), {"w": 0}), Pieces(Bucket(w=full[3:]), {"w": 3})])
    tensors = assemble(bucket, allocate(opened))
    assert len(opened) == 1 and torch.equal(tensors["w"], full)
    assert dict(opened[0].bucket.items())["w"].tolist() == full.tolist()  # what a worker reads
    del tensors
    opened[0].close()
