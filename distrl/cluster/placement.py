"""Placement groups per role (or one shared group when roles are colocated), with a clear error when the cluster
cannot hold them. Only Ray actors are placed: on the local backend every role's placement is None.

Beside `distrl.cluster.backend` (it asks which backend runs the workers), below `distrl.cluster.group`, whose
`start_group` puts each actor on its bundle. Ray is imported when a placement is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrl.cluster.backend import Backend, RayBackend
from distrl.config import RoleResources

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup

READY_TIMEOUT_S = 120


@dataclass
class Placement:
    """Where a role's Ray actors go: a placement group and the bundle index of each actor."""

    group: PlacementGroup
    bundle_indices: list[int]

    def scheduling(self, index: int) -> Any:
        """Ray's scheduling strategy that puts actor `index` of the role on its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        return PlacementGroupSchedulingStrategy(placement_group=self.group,
                                                placement_group_bundle_index=self.bundle_indices[index])


def _bundle(r: RoleResources) -> dict[str, float]:
    bundle = {"CPU": r.num_cpus}
    if r.num_gpus:
        bundle["GPU"] = r.num_gpus
    return bundle


def place(backend: Backend, roles: dict[str, RoleResources], colocate: bool, run_name: str,
          ) -> dict[str, Placement | None]:
    """Reserve each role's resources on `backend`: on Ray, one placement group per role (PACK), or a single group
    for all roles when `colocate`; named `distrl/<run>/<role>` like the actors, so two runs can share a cluster.
    Nothing (None for every role) on a backend without Ray actors.

    Raises RuntimeError naming each role's demand and the cluster's resources if the groups cannot be placed.
    """
    if not isinstance(backend, RayBackend):
        return dict.fromkeys(roles)
    from ray.util.placement_group import placement_group

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
    return dict(placements)


def _wait(groups, roles: dict[str, RoleResources]) -> None:
    import ray
    from ray.util.placement_group import remove_placement_group

    ready, _ = ray.wait([g.ready() for g in groups], num_returns=len(groups), timeout=READY_TIMEOUT_S)
    if len(ready) < len(groups):
        for g in groups:
            remove_placement_group(g)
        demand = ", ".join(f"{role}: {r.num_actors} x (cpus={r.num_cpus}, gpus={r.num_gpus})"
                           for role, r in roles.items())
        raise RuntimeError(f"the cluster cannot place the actors within {READY_TIMEOUT_S}s: need {demand}; "
                           f"cluster has {ray.cluster_resources()}. Lower cluster.<role>.num_cpus / num_gpus / "
                           f"num_actors or add nodes.")


def release(placements: dict[str, Placement | None]) -> None:
    """Remove the placement groups of `placements` (each once; nothing where no role was placed)."""
    groups = {id(p.group): p.group for p in placements.values() if p is not None}
    if not groups:
        return
    from ray.util.placement_group import remove_placement_group

    for g in groups.values():
        remove_placement_group(g)
