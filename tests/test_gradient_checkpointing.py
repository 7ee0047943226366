"""`learner.gradient_checkpointing` (on in every shipped GPU config) changes memory, not numbers: with packed
attention, the loss and the gradients of one micro-batch are the same with it on and off (replicated learner), and
two FSDP learners with it on train as one replicated learner with it off (gloo on the CPU).

Tolerance: activations are recomputed by the same kernels on the same inputs, so in float32 on the CPU the results
agree to rounding (rtol 1e-5, atol 1e-7 on the loss and the gradients); the FSDP comparison uses
`test_learner_fsdp.assert_same_training`'s tolerances (AdamW steps, atol 3e-5 on the weights)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import torch
from test_learner import batch, make_learner
from test_learner_fsdp import assert_same_training, scenario, single_learner_run
from test_sharding import _spawn

from distrl.workers.training.trainer import Counts


def loss_and_gradients(model_dir: Path, checkpointing: bool) -> tuple[torch.Tensor, dict[str, torch.Tensor], int]:
    """The policy loss of test_learner's batch (with its own log-probs as old ones), the gradient of every
    parameter, and how many times the first decoder layer ran again in the backward (recomputed), from a fresh
    replicated learner with `gradient_checkpointing` as given."""
    learner = make_learner(model_dir, gradient_checkpointing=checkpointing)
    assert learner.model.is_gradient_checkpointing is checkpointing
    data = replace(batch(), old_logprobs=learner.logprobs(batch().sequences))
    mask = data.response_mask
    counts = Counts(float(mask.sum()), float((mask.sum(-1) > 0).sum()))
    loss, _ = learner._policy_loss(learner.model, data, counts)
    recomputed = []
    layer = learner.model.get_decoder().layers[0]
    # A pre-hook: non-reentrant checkpointing stops the recompute once it has the tensors it needs, before the
    # layer returns, so a forward hook would not fire.
    handle = layer.register_forward_pre_hook(lambda module, args: recomputed.append(1))
    try:
        loss.backward()
    finally:
        handle.remove()
    grads = {name: p.grad.clone() for name, p in learner.model.named_parameters() if p.grad is not None}
    return loss.detach(), grads, len(recomputed)


def test_gradient_checkpointing_gives_the_same_loss_and_gradients(tiny_model_dir):
    loss_on, grads_on, recomputed_on = loss_and_gradients(tiny_model_dir, checkpointing=True)
    loss_off, grads_off, recomputed_off = loss_and_gradients(tiny_model_dir, checkpointing=False)
    assert (recomputed_on, recomputed_off) == (1, 0)  # the layer really ran again in the backward
    torch.testing.assert_close(loss_on, loss_off, rtol=1e-5, atol=1e-7)
    assert grads_on.keys() == grads_off.keys() and len(grads_on) > 0
    for name, grad in grads_off.items():
        assert grad.abs().max() > 0 or name.endswith("bias"), name  # every weight is reached by the loss
        torch.testing.assert_close(grads_on[name], grad, rtol=1e-5, atol=1e-7, msg=name)


def scenario_checkpointing(rank: int, world: int, port: int, model_dir: Path, out: Path) -> dict:
    """test_learner_fsdp's two sharded learners, with gradient checkpointing on (recompute under FSDP2's hooks)."""
    return scenario(rank, world, port, model_dir, out, gradient_checkpointing=True)


def test_sharded_learners_with_gradient_checkpointing_train_as_one_learner_without(tiny_model_dir, tmp_path):
    result = _spawn("test_gradient_checkpointing:scenario_checkpointing", tiny_model_dir, tmp_path)
    assert_same_training(result, *single_learner_run(tiny_model_dir))
