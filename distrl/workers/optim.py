"""AdamW with linear warm-up then a constant or cosine schedule (transformers' schedule functions)."""

from __future__ import annotations

import torch

from distrl.config import CosineSchedule, LearnerConfig


def build_optimizer(model: torch.nn.Module, cfg: LearnerConfig, total_steps: int):
    """(optimizer, lr scheduler) for `total_steps` optimizer steps."""
    from transformers import get_constant_schedule_with_warmup, get_cosine_with_min_lr_schedule_with_warmup

    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, betas=cfg.betas, weight_decay=cfg.weight_decay)
    if isinstance(cfg.lr_schedule, CosineSchedule):
        scheduler = get_cosine_with_min_lr_schedule_with_warmup(
            optimizer, num_warmup_steps=cfg.warmup_steps, num_training_steps=total_steps,
            min_lr_rate=cfg.lr_schedule.min_lr_ratio,
        )
    else:
        scheduler = get_constant_schedule_with_warmup(optimizer, num_warmup_steps=cfg.warmup_steps)
    return optimizer, scheduler
