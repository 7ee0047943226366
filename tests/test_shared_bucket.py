"""Buckets in shared memory (`distrl.workers.rollout.shared_bucket`): written once by the rollout actor into a pool of
segments, read by other processes (a tensor-parallel engine's workers) through a few hundred bytes of description,
and a segment written again only once no worker holds a view of it."""

from __future__ import annotations

import multiprocessing as mp
import os
import pickle

import torch

from distrl.workers.rollout import shared_bucket
from distrl.workers.rollout.shared_bucket import ALIGN, SharedPool
from distrl.workers.weights.export import Bucket
from distrl.workers.weights.pieces import BucketParts, Pieces, assemble


def worker(buckets, out) -> None:
    """A worker process: reads each bucket, keeping the first one's views (as vLLM keeps an unfinished layer's
    tensors), and reports the values it read and the segments it holds after each."""
    kept = None
    for bucket in buckets:
        items = dict(bucket.items())
        values = {name: t.tolist() for name, t in items.items()}
        kept = kept or items
        del items
        out.put((values, shared_bucket.held_segments()))


def test_buckets_are_read_by_another_process_and_a_held_segment_is_not_written_again():
    pool = SharedPool()
    spec = [("a.weight", (2, 3)), ("b.bias", (3,))]
    first = pool.allocate(spec, torch.bfloat16)
    first["a.weight"].copy_(torch.arange(6.0).reshape(2, 3))
    first["b.bias"].copy_(torch.tensor([-1.0, 0.5, 2.0]))
    one = pool.bucket
    assert [offset % ALIGN for *_, offset in one.entries] == [0, 0]
    assert len(pickle.dumps(one)) < 400  # what vLLM's RPC carries to each worker: no tensor bytes
    second = pool.allocate([("c", (4,))], torch.float32)  # segment 0 is busy until the workers say otherwise
    second["c"].copy_(torch.tensor([1.0, 2.0, 3.0, 4.0]))
    two = pool.bucket
    assert (one.segment, two.segment) == (0, 1) and one.fd != two.fd

    context = mp.get_context("spawn")  # as vLLM starts its workers
    out = context.Queue()
    child = context.Process(target=worker, args=([one, two], out))
    child.start()
    (read_one, held_one), (read_two, held_two) = out.get(timeout=120), out.get(timeout=120)
    child.join(timeout=60)
    assert read_one == {"a.weight": [[0.0, 1.0, 2.0], [3.0, 4.0, 5.0]], "b.bias": [-1.0, 0.5, 2.0]}
    assert read_two == {"c": [1.0, 2.0, 3.0, 4.0]}
    assert held_one == [0] and held_two == [0]  # the first bucket's views are still held, the second's let go

    pool.held(set(held_two))
    assert pool.allocate([("d", (4,))], torch.float32) and pool.bucket.segment == 1  # segment 1 is free again
    pool.held(set())
    assert pool.allocate([("e", (2,))], torch.float32) and pool.bucket.segment == 0  # the smallest free one
    assert len(pool.segments) == 2 and pool.nbytes == 2 * 2**20


def test_the_learners_pieces_are_assembled_straight_into_a_segment():
    pool = SharedPool()
    full = torch.arange(8.0).reshape(4, 2)
    bucket = BucketParts([("w", (4, 2))], [Pieces(Bucket(w=full[:3]), {"w": 0}), Pieces(Bucket(w=full[3:]), {"w": 3})])
    tensors = assemble(bucket, pool.allocate)
    assert torch.equal(tensors["w"], full)
    assert dict(pool.bucket.items())["w"].tolist() == full.tolist()  # what a worker reads
    fd_path = f"/proc/{os.getpid()}/fd/{pool.segments[0].fd}"
    assert "memfd:distrl-weights-0" in os.readlink(fd_path)
