"""Data granularity ``episode``: a multi-turn episode trained as one sequence (system, each turn's
observation and reply encoded once, a loss mask over the replies only) has the loss of its step
samples; episodes that are not one sequence fall back to step samples with a counted reason."""

from __future__ import annotations

import base64
import dataclasses
import io
from pathlib import Path
from typing import Any

import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from test_data_manager import Cfg, make_record  # noqa: E402

from osfarm.policy.tiny import tiny_model_dir  # noqa: E402
from osfarm.trainer.data_config import DataConfig  # noqa: E402
from osfarm.trainer.data_manager import DataManager  # noqa: E402
from osfarm.trainer.learner import Learner, LearnerOptions, LossOptions  # noqa: E402
from osfarm.trainer.samples import HISTORY_CUT, REPLY_REWRITTEN, Sample, join_episode  # noqa: E402


def _png(color: tuple[int, int, int]) -> str:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (84, 56), color).save(buf, "PNG")  # a few patches: a cheap vision pass
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


SYSTEM = {"role": "system", "content": "You control a Linux desktop."}
REPLIES = ["Thought: the file manager.\nAction: click(start_box='(10,20)')", "Action: type(content='ls')",
           "Action: finished()"]


@pytest.fixture(scope="module")
def learner() -> Learner:
    return Learner(tiny_model_dir(), LearnerOptions(lr=1e-12))  # the weights stay put across updates


def _reply_ids(lrn: Learner, text: str) -> list[int]:
    tok = lrn.processor.tokenizer
    return [*tok(text, add_special_tokens=False)["input_ids"], tok.convert_tokens_to_ids("<|im_end|>")]


def _steps(lrn: Learner, *, episode: str = "e", advantage: float = 1.0, images: bool = True,
           replies: list[str] = REPLIES, behav: bool = True) -> list[Sample]:
    """An episode's step samples as the agent sent them (each prompt the whole history so far),
    with behaviour log-probs off the current ones by a different amount per turn (``behav``)."""
    history: list[dict[str, Any]] = [SYSTEM]
    out = []
    for i, reply in enumerate(replies):
        parts: list[dict[str, Any]] = [{"type": "text", "text": f"Step {i + 1}: what do you do?"}]
        if images:
            parts.append({"type": "image_url", "image_url": {"url": _png((60 * i, 90, 200 - 60 * i))}})
        prompt = [*history, {"role": "user", "content": parts}]
        s = Sample(messages=prompt, response_token_ids=_reply_ids(lrn, reply), behav_logprobs=None,
                   policy_version=i, advantage=advantage, reward=float(advantage > 0), task_id="t", group_id="g",
                   episode_id=episode, step_index=i + 1, response_text=reply)
        if behav:
            s.behav_logprobs = [x + (0.3 if i % 2 else -0.2) * (i + 1) for x in lrn.score(s)]
        out.append(s)
        history = [*prompt, {"role": "assistant", "content": reply}]
    return out


@pytest.fixture(scope="module")
def with_images(learner: Learner) -> list[Sample]:
    """A 3-step episode with a screenshot per turn (built once: scoring it costs vision passes)."""
    return _steps(learner)


def _joined(steps: list[Sample]) -> Sample:
    ep = join_episode(steps)
    assert isinstance(ep, Sample), ep
    return ep


def test_the_loss_mask_covers_each_reply_and_no_observation_or_system_token(learner: Learner,
                                                                          with_images: list[Sample]) -> None:
    steps = with_images
    ep = _joined(steps)
    enc = learner.encode(ep)
    tok = learner.processor.tokenizer
    ids = enc.inputs["input_ids"][0]
    scored = ids[enc.prompt_len:]
    mask = enc.train_mask
    assert mask is not None and scored.numel() == mask.numel() == enc.response_len
    # the trained tokens are exactly the sampled replies, in order
    assert scored[mask > 0].tolist() == [t for s in steps for t in s.response_token_ids or []]
    assert enc.trained_len == sum(len(s.response_token_ids or []) for s in steps)
    # everything before the first reply (system prompt, first observation) is outside the scored part
    assert "Linux desktop" in tok.decode(ids[:enc.prompt_len]) and enc.prompt_len > 0
    untrained = tok.decode(scored[mask == 0])
    assert "Step 2" in untrained and "Step 3" in untrained and "Linux desktop" not in untrained
    pad = tok.convert_tokens_to_ids("<|image_pad|>")
    assert (scored == pad).sum() > 0 and not bool((scored[mask > 0] == pad).any())  # screenshots 2, 3: masked
    # each reply starts right after its turn's "<|im_start|>assistant\n"
    on = torch.nonzero(mask).reshape(-1).tolist()
    starts = [p for p in on if p == 0 or p - 1 not in on]
    assert len(starts) == 3
    for p in starts:
        before = ids[:enc.prompt_len + p].tolist()
        assert tok.decode(before).endswith("<|im_end|>\n<|im_start|>assistant\n")


@pytest.mark.parametrize("aggregation", ["token_mean", "seq_mean"])
def test_an_episode_sequence_has_the_loss_of_its_step_samples(learner: Learner, with_images: list[Sample],
                                                               aggregation: str) -> None:
    """One forward pass over the episode scores every reply as its own prompt did (causal
    attention: the same prefix), each turn's importance weight from its own behaviour log-probs;
    with a one-step episode beside it, episode weighting and micro-batches of 2."""
    steps = with_images  # behaviour log-probs differ per turn: misaligned, the loss would differ
    other = _steps(learner, episode="short", advantage=-1.0, images=False, replies=["Action: wait()"])
    ep = _joined(steps)
    if aggregation == "token_mean":  # the log-probs themselves, once
        assert learner.score(ep) == pytest.approx([x for s in steps for x in learner.score(s)], abs=1e-4)
    saved = learner.opts
    try:
        learner.opts = saved.model_copy(update={"micro_batch_size": 2, "loss": LossOptions(
            behav_cap=None, aggregation=aggregation, episode_weighting=True)})
        per_step = learner.update([*steps, *other])
        one_sequence = learner.update([ep, *other])
        assert one_sequence.extra["episode_samples"] == 1.0 and one_sequence.samples == 2
        assert per_step.extra["turns"] == one_sequence.extra["turns"] == 4.0
        assert one_sequence.loss == pytest.approx(per_step.loss, rel=1e-4, abs=1e-6)
        assert one_sequence.grad_norm == pytest.approx(per_step.grad_norm, rel=1e-3)
        assert one_sequence.kl_prox_behav == pytest.approx(per_step.kl_prox_behav, rel=1e-4, abs=1e-6)
        # each turn's own π_b: another turn's log-probs in its place give another loss
        wrong = dataclasses.replace(ep, turns=[{**t, "logprobs": [x + 0.5 for x in t["logprobs"]] if k == 1
                                                else t["logprobs"]} for k, t in enumerate(ep.turns or [])])
        assert abs(learner.update([wrong, *other]).loss - per_step.loss) > 1e-3
    finally:
        learner.opts = saved


def test_a_reply_that_retokenises_differently_trains_apart_and_the_rest_stays_one_sequence(learner: Learner) -> None:
    """The history holds the reply's text; where that text encodes to other ids than the policy
    sampled (a byte token of a random model, a non-canonical split), that turn is not in place in
    the joined sequence: it trains as its own step sample and the episode's other turns stay one
    sequence (they were prompted with the text's ids, which the sequence holds). The loss is the
    step samples'. With one turn left in place the episode trains per step."""
    steps = _steps(learner, images=False, behav=False)
    tok = learner.processor.tokenizer
    # the first reply sampled character by character: the same text, other ids than it encodes to
    first = steps[0]
    chars = [i for ch in first.response_text for i in tok(ch, add_special_tokens=False)["input_ids"]]
    assert tok.decode(chars) == first.response_text and chars != (first.response_token_ids or [])[:-1]
    steps[0] = dataclasses.replace(first, response_token_ids=[*chars, tok.convert_tokens_to_ids("<|im_end|>")])
    ep = _joined(steps)  # the messages agree: only the token level tells
    with pytest.raises(ValueError, match="reply_retokenized"):
        learner.encode(ep)
    per_step = learner.update(steps)
    split = learner.update([ep])
    assert split.extra["episode_fallback_turn_retokenized"] == 1.0 and split.extra["episode_samples"] == 1.0
    assert split.samples == 2 and split.extra["turns"] == 3.0
    assert split.loss == pytest.approx(per_step.loss, rel=1e-5, abs=1e-7)
    # both earlier replies re-tokenised: the last turn alone is in place, no sequence is left
    second = steps[1]
    chars = [i for ch in second.response_text for i in tok(ch, add_special_tokens=False)["input_ids"]]
    steps[1] = dataclasses.replace(second, response_token_ids=[*chars, tok.convert_tokens_to_ids("<|im_end|>")])
    fallback = learner.update([_joined(steps)])
    assert fallback.extra["episode_fallback_reply_retokenized"] == 1.0 and fallback.samples == 3
    assert fallback.extra["episode_samples"] == 0.0


def test_an_episode_over_the_budget_trains_the_steps_that_fit(learner: Learner) -> None:
    """The budget's max_prompt_tokens is the longest prompt the server took: an episode whose
    sequence is over it is not cut, it trains as its steps, and the steps over it are left out."""
    steps = _steps(learner, images=False, behav=False)
    lengths = [learner.encode(s).prompt_len for s in steps]
    budget = type(learner.opts.budget)(max_prompt_tokens=(lengths[1] + lengths[2]) // 2)
    saved = learner.opts
    learner.opts = saved.model_copy(update={"budget": budget})
    try:
        stats = learner.update([_joined(steps)])
    finally:
        learner.opts = saved
    assert stats.extra["episode_fallback_over_budget"] == 1.0 and stats.extra["overlong_samples"] == 1.0
    assert stats.samples == 2 and stats.tokens == sum(len(s.response_token_ids or []) for s in steps[:2])


def test_an_update_holds_one_micro_batch_of_episodes_at_a_time(learner: Learner) -> None:
    """Episode samples are encoded when their micro-batch runs and dropped after it, as step samples are."""
    import gc

    from osfarm.trainer.batching import Encoded

    episodes = [_joined(_steps(learner, episode=f"e{i}", images=False, behav=False, advantage=1.0 if i % 2 else -1.0))
                for i in range(4)]
    alive: list[int] = []
    saved = learner.opts
    learner.opts = saved.model_copy(update={"micro_batch_size": 2})
    hook = learner.model.register_forward_pre_hook(
        lambda *_: alive.append(sum(isinstance(o, Encoded) for o in gc.get_objects())))
    try:
        stats = learner.update(episodes)
    finally:
        hook.remove()
        learner.opts = saved
    assert stats.extra["episode_samples"] == 4.0
    assert len(alive) == 2 * 2 and max(alive) <= 2, alive  # two passes of two micro-batches


# -- the data manager's side: which episodes are joined, and why the others are not ---------------------------


def test_the_data_manager_joins_an_episode_that_is_one_conversation(tmp_path: Path) -> None:
    dm = DataManager(Cfg(group_size=2, granularity="episode"), blob_root=tmp_path)
    dm.add(make_record(tmp_path, status="success", steps=3))
    dm.add(make_record(tmp_path, status="failure", steps=3))
    batch = dm.take_batch()
    assert len(batch.samples) == 2 and batch.counts["episode_samples"] == 2
    s = batch.samples[0]
    assert s.whole_episode and [(t["message_index"], t["step_index"]) for t in s.turns or []] == \
        [(3, 1), (5, 2), (7, 3)]
    assert [t["logprobs"][0] for t in s.turns or []] == [-0.5] * 3
    assert s.messages[7] == {"role": "assistant", "content": "Action: click 3"}


def test_episodes_that_are_not_one_conversation_stay_step_samples_and_are_counted(tmp_path: Path) -> None:
    def steps(rec: dict[str, Any]) -> list[Sample]:
        dm = DataManager(Cfg(group_size=2), blob_root=tmp_path)
        dm.add(rec)
        dm.add(make_record(tmp_path, status="failure", steps=2))
        return [s for s in dm.take_batch().samples if s.episode_id == rec["episode_id"]]

    good = steps(make_record(tmp_path, status="success", steps=3))
    # the agent kept only its last turn: step 3's prompt no longer holds step 1
    cut = [*good[:2], dataclasses.replace(good[2], messages=[*good[2].messages[:2], *good[2].messages[4:]])]
    assert join_episode(cut) == HISTORY_CUT
    rewritten = [dataclasses.replace(good[0], response_text="Action: click 9"), *good[1:]]
    assert join_episode(rewritten) == REPLY_REWRITTEN
    # an agent without history asks every step the same prompt: no turn holds the one before it,
    # even where the replies agree (every turn would train on one message)
    same = [dataclasses.replace(good[2], step_index=i, response_text=good[2].response_text) for i in (1, 2)]
    assert join_episode(same) == HISTORY_CUT
    # a step left out (high-entropy selection) stays in the conversation as context, untrained
    ep = join_episode([good[0], good[2]])
    assert isinstance(ep, Sample) and [t["message_index"] for t in ep.turns or []] == [3, 7]
    # the learner's context_turns cut each prompt: the data manager does not join them
    dm = DataManager(Cfg(group_size=2, granularity="episode", context_turns=1), blob_root=tmp_path)
    dm.add(make_record(tmp_path, status="success", steps=3))
    dm.add(make_record(tmp_path, status="failure", steps=3))
    batch = dm.take_batch()
    assert batch.counts["episode_fallback_context_trimmed"] == 2 and batch.counts["episode_samples"] == 0
    assert len(batch.samples) == 6 and not any(s.whole_episode for s in batch.samples)


def test_granularity_is_validated() -> None:
    assert DataConfig(granularity="episode").granularity == "episode"
    with pytest.raises(ValueError, match="granularity must be 'step', 'episode' or 'trajectory'"):
        DataConfig(granularity="sequence")  # type: ignore[arg-type]


def test_granularity_episode_gives_the_agent_the_whole_episode_as_history(caplog: pytest.LogCaptureFixture) -> None:
    """An episode is one sequence only when each prompt holds every earlier turn: under
    granularity episode the agent's unset history window is the whole episode (both agents);
    otherwise each kind keeps its own default, and a window set below the episode is warned about."""
    from osfarm.trainer.config import TrainConfig
    from osfarm.trainer.run_wiring import rollout_agent_options

    def cfg(kind: str, granularity: str = "step", **agent: Any) -> TrainConfig:
        return TrainConfig.model_validate({"agent": {"kind": kind, **agent}, "rollout": {"max_steps": 15},
                                           "data": {"options": {"granularity": granularity}}})

    for kind in ("choice", "vlm"):
        a = cfg(kind, "episode").agent
        assert (a.history_turns, a.history_images) == (15, 15)
        opts = rollout_agent_options(a, "http://127.0.0.1:1", "policy")
        assert (opts["history_turns"], opts["history_images"]) == (15, 15)
    assert (cfg("choice").agent.history_turns, cfg("vlm").agent.history_turns) == (0, 2)
    assert cfg("vlm").agent.history_images == 1
    with caplog.at_level("WARNING", logger="osfarm.trainer"):
        assert cfg("vlm", "episode", history_turns=3).agent.history_turns == 3
    assert "episode_fallback_history_cut" in caplog.text
