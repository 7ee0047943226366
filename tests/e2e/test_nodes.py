"""Several nodes for real (`tests/e2e/nodes.py`: the session's head, inference and training nodes on 127.0.0.1, each
its own raylet and object store, and nodes the tests add and lose):

- roles land on the nodes their labels and custom resources name (engines on the inference node, two FSDP learners
  on two nodes, their gloo group across them, the reference on the head) and give the rows, step for step, of the
  same seed with every role on one node; pushes cross nodes through the object store;
- in the asynchronous loop, an engine joins when a node with room joins, one is let go when its node is lost above
  `cluster.rollout.min_actors`, and one lost at that bound is replaced once a node with its label comes; the run
  logs every step once and leaves no actor or placement group behind;
- a killed engine is replaced in the running job, and a learner whose node is lost is recovered from the newest
  checkpoint, its roles placed again once a node with its label has joined; every step is logged once, every
  prompt trained once.

Both asynchronous runs use partial rollouts, so their faults find samples that straddle steps: each prompt is
trained once, with all its samples, none lost (`faults.check_each_prompt_trained_once`).
"""

from __future__ import annotations

import os
import re
import time

from distrl.driver import train

from .conftest import outcome
from .faults import check_each_prompt_trained_once, kill_actor
from .nodes import Nodes, Watch, actors_of, joined, leftovers
from .test_service import check_topology, topology

# Partial rollouts, samples of up to 16 tokens drawn 4 at a time, and every step's samples written (their tickets):
# the faults below find samples that straddle steps. At k = 2: the batch a step takes is generated while the update
# before it runs, so at k = 1 no other group is open when it is handed out (a sample never straddles a step there).
PARTIAL = ("loop.max_staleness=2", "loop.partial_rollouts=true", "loop.slice_tokens=4", "run.samples_every=1")


def node_of(nodes: Nodes, name: str) -> str:
    return nodes.named[name].node_id


def test_roles_placed_by_node_give_the_rows_of_one_node(ray_session, tmp_path):
    """The 2x2 topology of test_service (GSPO, ICEPop, a bf16 engine, two FSDP learners with a token budget) with
    its engines on the inference node, its learners on the head and the training node (one `learner_slot` each:
    their gloo group crosses nodes), the reference on the head; then every role on the head: the same rows."""
    nodes: Nodes = ray_session
    name = "2x2-gspo-icepop-fsdp"
    spread = topology(tmp_path / "spread", name, "run.name=spread", "cluster.rollout.labels={pool: inference}",
                      "cluster.learner.resources={learner_slot: 1}", "cluster.reference.labels={pool: head}")
    one = topology(tmp_path / "one", name, "run.name=one", "cluster.rollout.labels={pool: head}",
                   "cluster.learner.labels={pool: head}", "cluster.reference.labels={pool: head}")
    check_topology(spread, train(spread), tmp_path / "spread")
    where = {name.rsplit("/", 1)[1]: a["node_id"] for name, a in actors_of("spread").items()}
    assert where["rollout-0"] == where["rollout-1"] == node_of(nodes, "inference")
    assert where["reference-0"] == node_of(nodes, "head")
    assert {where["learner-0"], where["learner-1"]} == {node_of(nodes, "head"), node_of(nodes, "train")}
    check_topology(one, train(one), tmp_path / "one")
    assert {a["node_id"] for a in actors_of("one").values()} == {node_of(nodes, "head")}
    spread_rows = outcome(tmp_path / "spread" / "spread" / "metrics.jsonl")
    assert spread_rows == outcome(tmp_path / "one" / "one" / "metrics.jsonl")
    assert leftovers("spread") == ([], []) and leftovers("one") == ([], [])


def total(rows: list[dict], key: str) -> float:
    return sum(r.get(key, 0.0) for r in rows)


def test_engines_join_leave_and_are_replaced_with_their_nodes_in_the_asynchronous_loop(ray_session, tmp_path):
    """One engine at start on the only `pool: spot` node; a second spot node joins and a second engine starts
    there; the first node is lost above min_actors (its engine is let go); the second is lost at min_actors (its
    engine is replaced, and waits for the third spot node the test adds)."""
    nodes: Nodes = ray_session
    spot = [nodes.add(labels={"pool": "spot"})]
    run = tmp_path / "elastic"
    watch = Watch(joined(nodes, tmp_path, "run.name=elastic", "loop.mode=async", "run.steps=100000",
                         "rollout.prompts_per_step=4", *PARTIAL, "run.samples_per_write=32",
                         "learner.micro_batch_size=8", "cluster.rollout.num_cpus=1",
                         "cluster.rollout.labels={pool: spot}", "cluster.rollout.min_actors=1",
                         "cluster.rollout.max_actors=2", "cluster.recovery.start_timeout_s=180"), run)
    try:
        watch.until("two steps", lambda rows: len(rows) >= 2)
        spot.append(nodes.add(labels={"pool": "spot"}))  # a node joins: the engine waiting for room starts there
        rows = watch.until("a second engine", lambda rows: total(rows, "rollout/engines_added") >= 1)
        at_faults = [len(watch.until("steps with two engines", lambda r: len(r) >= len(rows) + 3))]
        nodes.lose(spot[0])  # above min_actors: its engine is let go
        rows = watch.until("the first engine let go", lambda rows: total(rows, "faults/rollout_retired") >= 1)
        at_faults.append(len(watch.until("steps with one engine", lambda r: len(r) >= len(rows) + 2)))
        killed = nodes.lose(spot[1])  # at min_actors: its engine is replaced, once Ray declares it dead, and the
        # replacement waits for a spot node: one joins once the replacement has started
        deadline = time.monotonic() + 120
        while "starting a replacement on its placement bundle" not in watch.log.read_text():
            assert time.monotonic() < deadline and watch.proc.poll() is None, watch.log.read_text()[-4000:]
            time.sleep(0.5)
        spot.append(nodes.add(labels={"pool": "spot"}))
        rows = watch.until("the replacement", lambda rows: total(rows, "faults/rollout_restarts") >= 1)
        recovered_s = time.monotonic() - killed
        # k + 3 steps after it, so that a prompt lost at the last fault would show (check_each_prompt_trained_once)
        watch.until("steps after the replacement", lambda r: len(r) >= len(rows) + 5)
        log = watch.stop()
    finally:
        if watch.proc.poll() is None:
            watch.proc.kill()
        nodes.remove_added()
    assert watch.proc.returncode == 143, log[-4000:]
    rows = watch.rows()
    print("partial/carried_tokens by step:", [r["partial/carried_tokens"] for r in rows], "nodes lost after rows",
          at_faults, "partial/redispatched_tokens:", total(rows, "partial/redispatched_tokens"))
    assert [r["step"] for r in rows] == list(range(1, len(rows) + 1))  # every step once
    assert max(r["rollout/engines"] for r in rows) == 2 and rows[-1]["rollout/engines"] == 1
    assert (total(rows, "rollout/engines_added"), total(rows, "faults/rollout_retired"),
            total(rows, "faults/rollout_restarts")) == (1, 1, 1)
    assert all(r["staleness/max"] <= 2 for r in rows) and total(rows, "samples/dropped_stale") == 0
    # Partial rollouts: samples were open (carried over) when each node was lost, and each prompt was trained once
    # all the same, none lost with the engines that held a slice of it.
    assert all(rows[i - 1]["partial/carried_tokens"] > 0 for i in at_faults), at_faults
    assert any(r["tokens/versions_spanned_max"] > 1 for r in rows)
    check_each_prompt_trained_once(run, len(rows), n=8, k=2)
    assert "letting it go, engines left: 1 (cluster.rollout.min_actors = 1)" in log
    assert "starting a replacement on its placement bundle" in log and "serves policy version" in log
    print(f"from the loss of the last engine's node to its replacement's first row: {recovered_s:.1f} s")
    assert leftovers("elastic") == ([], [])


def test_a_killed_engine_is_replaced_and_a_learner_whose_node_is_lost_is_recovered_from_its_checkpoint(
        ray_session, tmp_path):
    """Two faults in one asynchronous run with partial rollouts (starting one costs more than its steps): after
    step 2 the rollout actor's process is killed, and it is replaced in the running job, served the current weights
    and given back the samples it held, each with the prefix it was sent with; once step 4's checkpoint is written,
    the only `pool: trainer` node, the learner's, is lost and another trainer node joins: every role starts again,
    placed once that node is there, from the checkpoint, and the groups open then are sampled again from their
    prompts. (The synchronous loop's engine and learner deaths: tests/e2e/test_lora_recovery.py.)"""
    nodes: Nodes = ray_session
    trainer = nodes.add(labels={"pool": "trainer"})
    run = tmp_path / "faults"
    watch = Watch(joined(nodes, tmp_path, "run.name=faults", "run.steps=100000", "run.checkpoint_every=2",
                         "loop.mode=async", *PARTIAL, "run.samples_per_write=64",
                         "cluster.learner.labels={pool: trainer}", "cluster.recovery.start_timeout_s=180"), run)
    try:
        killed_after = watch.until("two steps", lambda rows: len(rows) >= 2)[-1]
        # The engine is generating slices of step 3's and 4's samples (a chunk in flight, or loading weights between
        # two: its death is then noticed at the push; either way it is replaced).
        kill_actor(os.getpid(), "RolloutWorker")
        watch.until("step 4's checkpoint", lambda _: (run / "checkpoints" / "step_000004" / "manifest.json").exists())
        killed = nodes.lose(trainer)
        lost_at = len(watch.rows())
        nodes.add(labels={"pool": "trainer"})
        rows = watch.until("the recovery", lambda rows: total(rows, "faults/recoveries") >= 1)
        recovered_s = time.monotonic() - killed
        # k + 3 steps after it, so that a prompt lost there would show (check_each_prompt_trained_once)
        watch.until("steps after the recovery", lambda r: len(r) >= len(rows) + 5)
        log = watch.stop()
    finally:
        if watch.proc.poll() is None:
            watch.proc.kill()
        nodes.remove_added()
    assert watch.proc.returncode == 143, log[-4000:]
    # Ray reports a killed actor dead, or (its death notice late on a busy machine) unavailable, then dead.
    assert re.search(r"rollout actor rollout-0 died \((ActorDiedError|ActorUnavailableError)\); starting a "
                     r"replacement", log), log[-4000:]
    assert "rollout actor rollout-0 (replacement 1) serves policy version" in log
    assert "learner-0 died in step" in log and "restarting every role from" in log
    rows = watch.rows()
    last = rows[-1]["step"]
    assert [r["step"] for r in rows] == list(range(1, last + 1))  # the steps after the checkpoint, redone once
    assert total(rows, "faults/rollout_restarts") == 1 and total(rows, "faults/recoveries") == 1
    assert all(r["learner/tokens"] > 0 for r in rows)
    assert all(r["staleness/max"] <= 2 for r in rows) and total(rows, "samples/dropped_stale") == 0
    # Samples were open (carried over) when the engine was killed and when the learner's node was lost; every prompt
    # was trained once all the same, with its 8 samples: those the dead engine held were sent again, and those open
    # at the recovery sampled again; the checkpoint the stop wrote records exactly the prompts trained.
    recovered_from = int(re.search(r"restarting every role from \S*step_(\d+)", log)[1])
    print("partial/carried_tokens by step:", [r["partial/carried_tokens"] for r in rows], "killed after step",
          killed_after["step"], "recovered from step", recovered_from, "partial/redispatched_tokens:",
          total(rows, "partial/redispatched_tokens"))
    assert killed_after["partial/carried_tokens"] > 0 and rows[recovered_from - 1]["partial/carried_tokens"] > 0
    check_each_prompt_trained_once(run, last, n=8, k=2)
    print(f"node lost after {lost_at} rows; from the loss to the first row after the recovery: {recovered_s:.1f} s; "
          f"steps redone: {lost_at - recovered_from}")
    assert leftovers("faults") == ([], [])


def test_roles_the_cluster_cannot_place_are_named_with_their_needs_and_the_nodes(ray_session):
    """Two roles that each fit on the inference node but not both at once: the capacity check (necessary
    conditions) lets them through, Ray cannot place them, and the wait ends naming the role still waiting, what its
    actors need and the nodes; nothing is left reserved."""
    import ray

    from distrl.cluster.backend import RayBackend
    from distrl.cluster.capacity import alive_nodes, problems
    from distrl.cluster.placement import place
    from distrl.config import ClusterConfig, RoleResources

    roles = {"rollout": RoleResources(num_cpus=0.75, labels={"pool": "inference"}),
             "reference": RoleResources(num_cpus=0.75, labels={"pool": "inference"})}
    assert problems(alive_nodes(), roles) == []

    def reserved() -> set[str]:
        return {g["name"] for g in ray.util.placement_group_table().values() if g["state"] != "REMOVED"}

    before = reserved()
    try:
        place(RayBackend(ClusterConfig()), roles, colocate=False, run_name="unplaceable", timeout_s=3)
    except RuntimeError as err:
        message = str(err)
    else:
        raise AssertionError("placed two roles of 0.75 CPU on a node of 1")
    assert message.startswith("the cluster cannot place the ") and "within cluster.placement_timeout_s = 3 s" in message
    assert "x (CPU=0.75; labels {'pool': 'inference'})" in message and "labels {'pool': 'train'}" in message
    deadline = time.monotonic() + 10  # removal is asynchronous in Ray's GCS
    while (after := reserved()) != before:
        assert time.monotonic() < deadline, after - before
        time.sleep(0.2)
