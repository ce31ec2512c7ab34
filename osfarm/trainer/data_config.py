"""The data manager's settings (DART's curation knobs), in a module of their own so that every
part of the curation (intake, grouping, samples) reads them without importing the manager."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal


@dataclass
class DataConfig:
    version_window: int | None = 1  # DART: the latest 2 checkpoints (current and current − 1); None: no limit
    group_size: int | None = None  # None: the task's dynamic rollout number (DART), at least min_group_size
    min_group_size: int = 2
    rollout_n: int = 8  # DART's n for tasks below the success threshold
    rollout_threshold: float = 0.6
    acc_max: float = 1.0  # a group whose mean reward is >= this is too easy (no signal)
    # False: groups without a GRPO signal (too easy, equal rewards) train too, with zero
    # advantages: the version still advances and the KL/entropy terms still act (a solved task
    # otherwise stops producing updates)
    drop_no_signal: bool = True
    std_normalize: bool = True  # False: Dr.GRPO
    unbiased_std: bool = False
    eps: float = 1e-6
    # step: a sample per step; episode: an episode's steps joined into one sequence where they
    # form one (samples.py), else its step samples; trajectory: the last step's whole request
    granularity: Literal["step", "episode", "trajectory"] = "step"
    context_turns: int | None = None  # cut each request to its last K turns (None: as the agent sent it)
    context_images: int | None = None  # keep only the last M screenshots (None: as sent)
    entropy_fraction: float = 0.8  # DART's high-entropy selection: keep this top fraction of a batch's samples
    novelty_lambda: float = 0.0  # XRPO's advantage sharpening of unlikely successes (0: off)
    # which step's policy version decides whether an episode is stale: the oldest ("start"), or the
    # newest ("end", for interruptible rollouts: older steps are then dropped one by one)
    episode_version: Literal["start", "end"] = "start"
    min_failure_steps: int = 2  # DART: keep a failure only if it ran at least this many steps
    timeout_as_failure: bool = True  # a timed-out episode is a failure (reward = its score)
    pool_per_task: int = 4  # successes kept per task in the experience pool
    use_pool: bool = True
    image_mode: Literal["path", "data_url"] = "path"
    stats_window: int = 32  # recent episodes behind a task's success rate
    parse_error_penalty: float = 0.0  # reward_shaping.py: subtracted per unparsable reply (0: off)
    step_penalty: float = 0.0  # reward_shaping.py: subtracted per step (0: off)

    def __post_init__(self) -> None:
        if self.granularity not in ("step", "episode", "trajectory"):
            raise ValueError(f"granularity must be 'step', 'episode' or 'trajectory', got {self.granularity!r}")
        if self.image_mode not in ("path", "data_url"):
            raise ValueError(f"image_mode must be 'path' or 'data_url', got {self.image_mode!r}")
        if not 0.0 <= self.entropy_fraction <= 1.0:
            raise ValueError(f"entropy_fraction must be in [0, 1], got {self.entropy_fraction}")
        if self.parse_error_penalty < 0 or self.step_penalty < 0:
            raise ValueError("parse_error_penalty and step_penalty must be >= 0")
        if self.novelty_lambda < 0:
            raise ValueError(f"novelty_lambda must be >= 0, got {self.novelty_lambda}")
        if self.episode_version not in ("start", "end"):
            raise ValueError(f"episode_version must be 'start' or 'end', got {self.episode_version!r}")
        if self.min_group_size < 2:
            raise ValueError(f"min_group_size must be >= 2 (a group of one has no advantage), "
                             f"got {self.min_group_size}")
