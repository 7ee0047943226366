"""Placement groups per role (or one shared group when roles are colocated), with a clear error when the cluster
cannot hold them."""

from __future__ import annotations

import ray
from ray.util.placement_group import placement_group, remove_placement_group

from distrl.cluster.group import Placement
from distrl.config import RoleResources

READY_TIMEOUT_S = 120


def _bundle(r: RoleResources) -> dict[str, float]:
    bundle = {"CPU": r.num_cpus}
    if r.num_gpus:
        bundle["GPU"] = r.num_gpus
    return bundle


def place(roles: dict[str, RoleResources], colocate: bool, run_name: str) -> dict[str, Placement]:
    """One placement group per role (PACK), or a single group for all roles when `colocate`; named
    `distrl/<run>/<role>` like the actors, so two runs can share a cluster.

    Raises RuntimeError naming each role's demand and the cluster's resources if the groups cannot be placed.
    """
    if colocate:
        bundles, indices, start = [], {}, 0
        for role, r in roles.items():
            bundles += [_bundle(r)] * r.num_actors
            indices[role] = list(range(start, start + r.num_actors))
            start += r.num_actors
        shared = placement_group(bundles, strategy="PACK", name=f"distrl/{run_name}/colocated")
        _wait([shared], roles)
        return {role: Placement(shared, indices[role]) for role in roles}
    placements = {role: Placement(placement_group([_bundle(r)] * r.num_actors, strategy="PACK",
                                                  name=f"distrl/{run_name}/{role}"), list(range(r.num_actors)))
                  for role, r in roles.items()}
    _wait([p.group for p in placements.values()], roles)
    return placements


def _wait(groups, roles: dict[str, RoleResources]) -> None:
    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=READY_TIMEOUT_S)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        demand = ", ".join(f"{role}: {r.num_actors} x (cpus={r.num_cpus}, gpus={r.num_gpus})"
                           for role, r in roles.items())
        raise RuntimeError(f"the cluster cannot place the actors within {READY_TIMEOUT_S}s: need {demand}; "
                           f"cluster has {ray.cluster_resources()}. Lower cluster.<role>.num_cpus / num_gpus / "
                           f"num_actors or add nodes.")


def release(placements: dict[str, Placement]) -> None:
    for g in {id(p.group): p.group for p in placements.values()}.values():
        remove_placement_group(g)
