"""Checks of where the roles may run (`cluster.<role>.labels`, `resources`, `accelerator_type`) and of the engines'
elastic bounds (`cluster.rollout.min_actors`, `max_actors`), on the `cluster` section, before anything starts.

What the cluster itself holds (which nodes carry the labels, how many CPUs and GPUs they have) is known only once
connected: `distrl.cluster.capacity` checks that, still before any actor starts.
"""

from __future__ import annotations

from distrl.config.cluster import ClusterConfig


def elastic_problems(c: ClusterConfig, max_staleness: int) -> list[str]:
    """Why `cluster.rollout`'s bounds (a number of engines that changes while the run goes on) cannot hold in this
    job, one message per reason."""
    r = c.rollout
    if not r.elastic:
        return []
    bounds = f"cluster.rollout.min_actors / max_actors ({r.fewest}..{r.most}, num_actors {r.num_actors})"
    problems = []
    if max_staleness == 0:
        problems.append(f"{bounds} need the asynchronous loop (loop.mode async): in the synchronous loop each step's "
                        f"batch is split among the engines that start with the run, and producers only scale apart "
                        f"from the learners when both run at once")
    if c.backend == "local":
        problems.append(f"{bounds} need Ray actors; cluster.backend is 'local'")
    if c.hybrid_mode:
        problems.append(f"{bounds} with cluster.colocate 'hybrid': each hybrid actor hosts one engine, so the engines "
                        f"scale with cluster.learner.num_actors")
    if c.colocate == "pack":
        problems.append(f"{bounds} with cluster.colocate 'pack': pack reserves every role's actors in one placement "
                        f"group, which cannot grow or shrink; use colocate 'none' (each engine is then placed on "
                        f"its own)")
    return problems


def unused_placement_problems(c: ClusterConfig) -> list[str]:
    """Labels, custom resources or a GPU model given to a role that this job does not place: in hybrid mode the
    hybrid actors take cluster.learner's, and cluster.rollout's and cluster.reference's would be ignored."""
    if not c.hybrid_mode:
        return []
    return [f"cluster.{role}.{field} with cluster.colocate 'hybrid': hybrid actors host the engine and the reference "
            f"and are placed by cluster.learner's; set it there"
            for role in ("rollout", "reference") for field in ("labels", "resources", "accelerator_type")
            if getattr(getattr(c, role), field)]
