"""Plain worker classes (rollout, reference, learner), reward functions and model loading; no Ray here."""
