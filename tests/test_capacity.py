"""Where roles may run: Ray's label selectors matched by hand-worked cases, what one actor needs of a node, and the
capacity check of a joined cluster, whose problems name the role and what is missing before any actor starts."""

import pytest

from distrl.cluster.capacity import Node, bundle, describe, fits, problems, selects
from distrl.config import RoleResources


@pytest.mark.parametrize("selector,labels,expected", [
    ({"pool": "rollout"}, {"pool": "rollout"}, True),
    ({"pool": "rollout"}, {"pool": "train"}, False),
    ({"pool": "rollout"}, {}, False),                                # a label the node lacks is not equal
    ({"pool": "!rollout"}, {"pool": "train"}, True),
    ({"pool": "!rollout"}, {}, True),                                # ... and is "not rollout"
    ({"pool": "!rollout"}, {"pool": "rollout"}, False),
    ({"pool": "in(head, train)"}, {"pool": "train"}, True),
    ({"pool": "in(head,train)"}, {"pool": "head"}, True),
    ({"pool": "in(head, train)"}, {"pool": "rollout"}, False),
    ({"pool": "!in(head, train)"}, {"pool": "rollout"}, True),
    ({"pool": "!in(head, train)"}, {"pool": "head"}, False),
    ({"pool": "train", "zone": "a"}, {"pool": "train", "zone": "b"}, False),  # every key must hold
    ({}, {"pool": "anything"}, True),
])
def test_label_selectors_match_as_ray_reads_them(selector, labels, expected):
    assert selects(selector, labels) is expected


def test_an_actors_bundle_holds_its_cpus_gpus_custom_resources_and_gpu_model():
    r = RoleResources(num_cpus=2, num_gpus=1, resources={"inference_node": 1}, accelerator_type="H100")
    assert bundle(r) == {"CPU": 2.0, "inference_node": 1.0, "GPU": 1.0, "accelerator_type:H100": 0.001}
    assert bundle(RoleResources(num_cpus=0.5)) == {"CPU": 0.5}


HEAD = Node({"pool": "head", "ray.io/node-id": "aa"}, {"CPU": 2.0})
GPU_A = Node({"pool": "inference"}, {"CPU": 8.0, "GPU": 2.0, "accelerator_type:H100": 1.0})
GPU_B = Node({"pool": "inference"}, {"CPU": 8.0, "GPU": 2.0, "accelerator_type:A100": 1.0})
TRAIN = Node({"pool": "train"}, {"CPU": 16.0, "GPU": 8.0, "learner_slot": 1.0})


def test_a_node_fits_an_actor_by_labels_and_every_resource():
    r = RoleResources(num_cpus=4, num_gpus=1, labels={"pool": "inference"}, accelerator_type="H100")
    assert fits(r, GPU_A) and not fits(r, GPU_B) and not fits(r, TRAIN)
    assert not fits(RoleResources(num_cpus=4, resources={"learner_slot": 2}), TRAIN)  # the node has 1


def test_a_cluster_that_holds_the_roles_has_no_problem():
    roles = {"rollout": RoleResources(num_actors=4, num_cpus=2, num_gpus=1, labels={"pool": "inference"}),
             "learner": RoleResources(num_actors=8, num_cpus=2, num_gpus=1, labels={"pool": "train"}),
             "reference": RoleResources(num_cpus=1, labels={"pool": "head"})}
    assert problems([HEAD, GPU_A, GPU_B, TRAIN], roles, reward_cpus=0.5) == []


def test_a_role_whose_labels_no_node_carries_is_named_with_the_nodes():
    roles = {"rollout": RoleResources(num_gpus=1, labels={"pool": "rollout"})}
    [problem] = problems([HEAD, GPU_A, TRAIN], roles)
    assert problem.startswith("cluster.rollout: no node can hold a rollout actor (CPU=1, GPU=1; labels "
                              "{'pool': 'rollout'}): no node carries its labels. The cluster's nodes: ")
    assert "1 x (CPU=2, GPU=0, labels {'pool': 'head'})" in problem  # Ray's own labels are left out
    assert "1 x (CPU=16, GPU=8, labels {'pool': 'train'})" in problem


def test_labelled_nodes_without_the_resources_of_one_actor_are_said_so():
    roles = {"learner": RoleResources(num_cpus=4, num_gpus=1, labels={"pool": "head"})}
    [problem] = problems([HEAD, TRAIN], roles)
    assert "1 node(s) carry its labels, but none has the resources of one actor" in problem


def test_a_role_that_needs_more_than_its_nodes_have_in_all_names_the_totals():
    roles = {"rollout": RoleResources(num_actors=3, num_cpus=1, num_gpus=2, labels={"pool": "inference"},
                                      accelerator_type="H100")}
    [problem] = problems([GPU_A, GPU_B, TRAIN], roles)
    assert problem == ("cluster.rollout: 3 actors x 2 GPU = 6 GPU, but the 1 node(s) that can hold a rollout actor "
                       "(CPU=1, GPU=2, accelerator_type:H100=0.001; labels {'pool': 'inference'}) have 2 in all")


def test_roles_that_fit_apart_but_not_together_are_refused_with_the_sum():
    roles = {"rollout": RoleResources(num_actors=2, num_cpus=1), "learner": RoleResources(num_actors=2, num_cpus=1)}
    [problem] = problems([HEAD, Node({}, {"CPU": 1.0})], roles, reward_cpus=0.05)
    assert problem == ("cluster: the roles reserve 4.05 CPU in all (rollout 2 x 1 + learner 2 x 1 + a reward task "
                       "0.05), but the cluster has 3")


def test_a_custom_resource_that_too_few_nodes_carry_is_counted_like_cpus():
    """The docs' layout: one `learner_node` per training node, so at most one learner per node. Two learners on one
    such node: each fits it, together they do not."""
    node = Node({"pool": "train"}, {"CPU": 8.0, "learner_node": 1.0})
    roles = {"learner": RoleResources(num_actors=2, num_cpus=1, resources={"learner_node": 1})}
    found = problems([HEAD, node], roles)
    assert found == ["cluster.learner: 2 actors x 1 learner_node = 2 learner_node, but the 1 node(s) that can hold "
                     "a learner actor (CPU=1, learner_node=1) have 1 in all",
                     "cluster: the roles reserve 2 learner_node in all (learner 2 x 1), but the cluster has 1"]
    assert problems([HEAD, node, Node({"pool": "train"}, {"CPU": 8.0, "learner_node": 1.0})], roles) == []


def test_no_nodes_are_described_as_none():
    assert describe([]) == "none alive"
