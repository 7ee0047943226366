"""Whether a joined cluster can hold what the config asks, checked once connected and before any actor starts: for
each role, nodes that carry its labels and resources and can hold one of its actors, and enough of every resource
its actors reserve (CPUs, GPUs, custom resources, the GPU model) on those nodes for all of them; and enough of each
in the whole cluster for every role at once. A problem names the role, what its actors need and what the cluster's
nodes have, instead of a placement group that waits for ever.

These are the conditions any placement needs (each role alone, and all of them together); Ray's placement
(`distrl.cluster.placement`) may still find the nodes too fragmented, and its timeout then names the roles that
wait. The nodes are read from Ray's node table (`ray.nodes()`: each alive node's labels and total resources).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from distrl.config import RoleResources


@dataclass(frozen=True)
class Node:
    """An alive node as the checks see it: its labels and its total resources (not what is free now: other jobs
    come and go, and what the run may ever use is what the node has)."""

    labels: Mapping[str, str]
    resources: Mapping[str, float]


def bundle(r: RoleResources) -> dict[str, float]:
    """One actor's reservation: CPUs, GPUs, custom resources and, for a GPU model, Ray's `accelerator_type:<model>`
    resource (which Ray gives nodes with such GPUs; a thousandth of it, as Ray's own `accelerator_type` option
    asks)."""
    reservation = {"CPU": r.num_cpus, **r.resources}
    if r.num_gpus:
        reservation["GPU"] = r.num_gpus
    if r.accelerator_type:
        reservation[f"accelerator_type:{r.accelerator_type}"] = 0.001
    return reservation


def where(r: RoleResources) -> str:
    """What a role's actors need of a node, for errors: its reservation and its labels."""
    needs = ", ".join(f"{k}={v:g}" for k, v in bundle(r).items())
    return f"({needs}" + (f"; labels {r.labels}" if r.labels else "") + ")"


def selects(selector: Mapping[str, str], labels: Mapping[str, str]) -> bool:
    """Whether a node with `labels` matches Ray's label selector `selector`: every key's condition holds (`v`: the
    label is v; `!v`: it is not, or absent; `in(a, b)`: one of them; `!in(a, b)`: none of them, or absent)."""
    for key, written in selector.items():
        negated = written.startswith("!")
        condition = written.removeprefix("!")
        values = ({v.strip() for v in condition[3:-1].split(",")} if condition.startswith("in(")
                  else {condition})
        if (labels.get(key) in values) == negated:
            return False
    return True


def fits(r: RoleResources, node: Node) -> bool:
    """Whether `node` may hold one actor of a role with resources `r` (labels, and every resource of its bundle)."""
    return selects(r.labels, node.labels) and all(node.resources.get(k, 0.0) >= v - 1e-9
                                                  for k, v in bundle(r).items())


def problems(nodes: list[Node], roles: Mapping[str, RoleResources], reward_cpus: float = 0.0) -> list[str]:
    """Why `nodes` cannot hold `roles` (role -> its resources), one line per problem, each starting with the role's
    config field; [] when they may. `reward_cpus`: what a reward task needs besides the actors."""
    found = []
    for role, r in roles.items():
        able = [n for n in nodes if fits(r, n)]
        if not able:
            labelled = [n for n in nodes if selects(r.labels, n.labels)]
            why = (f"{len(labelled)} node(s) carry its labels, but none has the resources of one actor"
                   if r.labels and labelled else "no node carries its labels" if r.labels
                   else "no node has the resources of one actor")
            found.append(f"cluster.{role}: no node can hold a {role} actor {where(r)}: {why}. The cluster's nodes: "
                         f"{describe(nodes)}")
            continue
        for resource, per_actor in bundle(r).items():
            have = sum(n.resources.get(resource, 0.0) for n in able)
            if per_actor * r.num_actors > have + 1e-9:
                found.append(f"cluster.{role}: {r.num_actors} actors x {per_actor:g} {resource} = "
                             f"{per_actor * r.num_actors:g} {resource}, but the {len(able)} node(s) that can hold a "
                             f"{role} actor {where(r)} have {have:g} in all")
    bundles = {role: bundle(r) for role, r in roles.items()}
    for resource in dict.fromkeys(k for b in bundles.values() for k in b):
        need = sum(r.num_actors * bundles[role].get(resource, 0.0) for role, r in roles.items())
        need += reward_cpus if resource == "CPU" else 0.0
        have = sum(n.resources.get(resource, 0.0) for n in nodes)
        if need > have + 1e-9:
            parts = " + ".join(f"{role} {r.num_actors} x {bundles[role][resource]:g}" for role, r in roles.items()
                               if bundles[role].get(resource))
            found.append(f"cluster: the roles reserve {need:g} {resource} in all ({parts}"
                         + (f" + a reward task {reward_cpus:g}" if resource == "CPU" and reward_cpus else "")
                         + f"), but the cluster has {have:g}")
    return found


def describe(nodes: list[Node]) -> str:
    """The nodes in one line: each kind of node (labels, CPUs, GPUs) with its count."""
    if not nodes:
        return "none alive"
    kinds = Counter(
        (tuple(sorted((k, v) for k, v in n.labels.items() if not k.startswith("ray.io/"))),
         n.resources.get("CPU", 0.0), n.resources.get("GPU", 0.0)) for n in nodes)
    return "; ".join(f"{count} x (CPU={cpu:g}, GPU={gpu:g}" + (f", labels {dict(labels)})" if labels else ")")
                     for (labels, cpu, gpu), count in kinds.items())


def alive_nodes() -> list[Node]:
    """The connected cluster's alive nodes (Ray's node table)."""
    import ray

    return [Node(labels=n.get("Labels") or {}, resources=n.get("Resources") or {}) for n in ray.nodes() if n["Alive"]]


def describe_nodes() -> str:
    return describe(alive_nodes())
