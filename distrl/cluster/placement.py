"""Placement groups per role (or one shared group when roles are colocated), on the nodes each role may use, with a
clear error when the cluster cannot hold them. Only Ray actors are placed: on the local backend every role's
placement is None.

A role's bundles carry its CPUs, GPUs, custom resources and GPU model (`cluster.<role>.resources`,
`accelerator_type`), and its label selector (`labels`) goes to Ray as the bundles' `bundle_label_selector`, so every
actor of the role, and every replacement, lands on a node the config allows. Engines whose number may change
(`cluster.rollout.min_actors` / `max_actors`) get one placement group each, so that one can be let go, or added
while the run goes on (`Placement.add`).

Beside `distrl.cluster.backend` (it asks which backend runs the workers), above `distrl.cluster.capacity` (what an
actor needs of a node), below `distrl.cluster.group`, whose `start_group` puts each actor on its bundle. Ray is
imported when a placement is made.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from distrl.cluster.backend import Backend, RayBackend
from distrl.cluster.capacity import bundle, describe_nodes, where
from distrl.config import RoleResources, RolloutResources

if TYPE_CHECKING:
    from ray.util.placement_group import PlacementGroup


@dataclass
class Slot:
    """Where one actor goes: bundle `bundle` of placement group `group`; `own`: the group holds this actor alone
    (and is removed when the actor is let go: `released`)."""

    group: PlacementGroup
    bundle: int
    own: bool = False
    released: bool = False


class Placement:
    """Where a role's Ray actors go: actor i on `slots[i]`."""

    def __init__(self, role: str, resources: RoleResources, run_name: str, slots: list[Slot]):
        self.role, self.resources, self.run_name, self.slots = role, resources, run_name, slots

    def scheduling(self, index: int) -> Any:
        """Ray's scheduling strategy that puts actor `index` of the role on its bundle."""
        from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

        slot = self.slots[index]
        return PlacementGroupSchedulingStrategy(placement_group=slot.group, placement_group_bundle_index=slot.bundle)

    def add(self) -> tuple[int, Any]:
        """Reserve one more actor's resources, in a placement group of its own on a node the role may use; returns
        (the new actor's index, a handle that resolves once Ray has placed the group: at once if a node has room,
        else when one joins)."""
        group = _group(self.resources, 1, f"distrl/{self.run_name}/{self.role}-{len(self.slots)}")
        self.slots.append(Slot(group, 0, own=True))
        return len(self.slots) - 1, group.ready()

    def withdraw(self) -> None:
        """Give back the room `add` reserved last, before any actor was started on it (a replacement needs the
        room first)."""
        from ray.util.placement_group import remove_placement_group

        slot = self.slots.pop()
        assert slot.own and not slot.released, "only an unused reservation of add() is withdrawn"
        remove_placement_group(slot.group)

    def release(self, index: int) -> None:
        """Give back actor `index`'s resources, if its placement group holds it alone (shared groups go at the end
        of the run, `release`)."""
        from ray.util.placement_group import remove_placement_group

        slot = self.slots[index]
        if slot.own and not slot.released:
            remove_placement_group(slot.group)
            slot.released = True

    def groups(self) -> list[PlacementGroup]:
        """The placement groups this role still holds, each once."""
        return list({id(s.group): s.group for s in self.slots if not s.released}.values())


def _group(r: RoleResources, n: int, name: str, strategy: str = "PACK") -> PlacementGroup:
    from ray.util.placement_group import placement_group

    return placement_group([bundle(r)] * n, strategy=strategy, name=name,
                           bundle_label_selector=[dict(r.labels)] * n if r.labels else None)


def place(backend: Backend, roles: dict[str, RoleResources], colocate: bool, run_name: str, timeout_s: float,
          setting: str = "cluster.placement_timeout_s") -> dict[str, Placement | None]:
    """Reserve each role's resources on `backend`: on Ray, one placement group per role (PACK), or a single group
    for all roles when `colocate`, or one per engine when their number may change; named `distrl/<run>/<role>`
    like the actors, so two runs can share a cluster. Nothing (None for every role) on a backend without Ray actors.

    Raises RuntimeError naming each role still waiting after `timeout_s` (the value of `setting`), what its actors
    need and which nodes the cluster has, and removes the groups it made.
    """
    if not isinstance(backend, RayBackend):
        return dict.fromkeys(roles)
    from ray.util.placement_group import placement_group

    placements: dict[str, Placement | None] = {}
    if colocate:
        bundles: list[dict[str, float]] = []
        selectors: list[dict[str, str]] = []
        indices: dict[str, list[int]] = {}
        for role, r in roles.items():
            indices[role] = list(range(len(bundles), len(bundles) + r.num_actors))
            bundles += [bundle(r)] * r.num_actors
            selectors += [dict(r.labels)] * r.num_actors
        shared = placement_group(bundles, strategy="PACK", name=f"distrl/{run_name}/colocated",
                                 bundle_label_selector=selectors if any(selectors) else None)
        placements = {role: Placement(role, r, run_name, [Slot(shared, i) for i in indices[role]])
                      for role, r in roles.items()}
    else:
        for role, r in roles.items():
            if isinstance(r, RolloutResources) and r.elastic:
                slots = [Slot(_group(r, 1, f"distrl/{run_name}/{role}-{i}"), 0, own=True) for i in range(r.num_actors)]
            else:
                group = _group(r, r.num_actors, f"distrl/{run_name}/{role}")
                slots = [Slot(group, i) for i in range(r.num_actors)]
            placements[role] = Placement(role, r, run_name, slots)
    wait_placed({role: p for role, p in placements.items() if p is not None}, timeout_s, setting)
    return placements


def wait_placed(placements: dict[str, Placement], timeout_s: float, setting: str) -> None:
    """Wait until Ray has placed every group of `placements`; after `timeout_s` (the value of `setting`), remove them
    and raise RuntimeError naming the roles still waiting, what their actors need, and the cluster's nodes."""
    import ray

    ready_of = {g.ready(): role for role, p in placements.items() for g in p.groups()}
    _, waiting = ray.wait(list(ready_of), num_returns=len(ready_of), timeout=timeout_s)
    if not waiting:
        return
    release(dict(placements))
    short = sorted({ready_of[h] for h in waiting})
    demand = "; ".join(f"{role}: {placements[role].resources.num_actors} x {where(placements[role].resources)}"
                       for role in short)
    raise RuntimeError(f"the cluster cannot place the {', '.join(short)} actors within {setting} = {timeout_s:g} s: "
                       f"{demand}. The cluster's nodes: {describe_nodes()}. Lower cluster.<role>.num_cpus / "
                       f"num_gpus / num_actors, loosen its labels or resources, or add nodes that have them")


def release(placements: dict[str, Placement | None]) -> None:
    """Remove the placement groups of `placements` (each once; nothing where no role was placed)."""
    groups = {id(g): g for p in placements.values() if p is not None for g in p.groups()}
    if not groups:
        return
    from ray.util.placement_group import remove_placement_group

    for g in groups.values():
        remove_placement_group(g)
