"""Asynchronous RL trainer (DART + AReaL): rollout controller, data manager, losses, learner, weight sync."""
