"""train.yaml: the README's example is a valid config whose recipe options reach the controller,
the data manager and the learner; bad combinations are refused naming the key."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from osfarm.trainer.config import TrainConfigError, load_train_config
from osfarm.trainer.loop import Trainer, TrainError, learner_options
from osfarm.trainer.run_wiring import in_process_farm_settings

ROOT = Path(__file__).resolve().parent.parent


def _readme_example(tmp_path: Path) -> Path:
    text = (ROOT / "README.md").read_text()
    block = re.search(r"## Training.*?```yaml\n(.*?)```", text, re.S)
    assert block, "README.md: no train.yaml example under '## Training'"
    f = tmp_path / "train.yaml"
    f.write_text(block.group(1))
    return f


def test_the_readme_example_configures_the_whole_recipe(tmp_path: Path) -> None:
    cfg = load_train_config(_readme_example(tmp_path))
    trainer = Trainer(cfg)
    dcfg = trainer.data_config()
    ccfg = trainer.controller_config(dcfg)
    assert ccfg.allocator == "dart" and ccfg.eta == 2 and ccfg.batch_size == 64 and ccfg.max_concurrent == 64
    assert dcfg.entropy_fraction == 0.8 and dcfg.version_window == 2
    opts, device = learner_options(cfg, rank=1)
    assert device == "cuda:5" and opts.reference_device == "cuda:5"
    assert opts.total_steps == cfg.updates * opts.minibatches and opts.lr_schedule == "cosine"
    assert cfg.eval_every == 10 and cfg.metrics.wandb.project == "osfarm"


def test_interruptible_rollouts_judge_staleness_by_the_newest_step(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("rollout: {interruptible: true, options: {allocator: fixed, group_size: 4, redundancy: 2}}\n")
    trainer = Trainer(load_train_config(f))
    dcfg = trainer.data_config()
    assert dcfg.episode_version == "end"
    ccfg = trainer.controller_config(dcfg)
    assert (ccfg.allocator, ccfg.group_size, ccfg.redundancy) == ("fixed", 4, 2)


def test_bad_combinations_name_the_key(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("eval_every: 5\n")
    with pytest.raises(TrainConfigError, match="eval_every needs eval_suite"):
        load_train_config(f)
    f.write_text("devices: {learner: [gpu0]}\n")
    with pytest.raises(TrainConfigError, match="devices.*'gpu0'"):
        load_train_config(f)
    f.write_text("nproc: 2\ndevices: {learner: [cuda:0, cuda:1, cuda:2]}\n")
    with pytest.raises(TrainConfigError, match="3 devices for nproc=2"):
        load_train_config(f)
    f.write_text("rollout: {options: {allocator: random}}\n")
    trainer = Trainer(load_train_config(f))
    with pytest.raises(TrainError, match="rollout.options: allocator"):
        trainer.controller_config(trainer.data_config())
    f.write_text("data: {options: {entropy_fraction: 2}}\n")
    with pytest.raises(TrainError, match="data.options: entropy_fraction"):
        Trainer(load_train_config(f)).data_config()


def test_spare_desktops_size_the_in_process_farm(tmp_path: Path) -> None:
    f = tmp_path / "t.yaml"
    f.write_text("rollout: {envs: 3}\nfarm: {spares: 4, overrides: {desktop: light}}\n")
    settings = in_process_farm_settings(load_train_config(f))
    assert (settings.pool_min, settings.pool_max, settings.desktop) == (7, 7, "light")
    f.write_text("farm: {spares: -1}\n")
    with pytest.raises(TrainConfigError, match="farm.spares"):
        load_train_config(f)
