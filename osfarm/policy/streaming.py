"""Token streaming: a generation, step by step, as each choice's new tokens, log-probs and text.

``StepObserver`` rides along ``model.generate`` as a stopping criterion, the one hook transformers
calls after every step with the sequences so far (and, with ``output_scores``, the processed
scores the new tokens were sampled from). It never stops a sequence itself: it reports what each
choice gained to ``emit`` (on the generation thread) and stops the whole generation once
``cancel`` is set (the client went away). A choice ends by the rules of a non-streamed one
(end-of-sequence token, stop string, ``max_tokens``) and its final text comes from the same
function (``finish``), so the streamed deltas concatenate to the non-streamed answer.

``IncrementalText`` turns a growing token sequence into text deltas: it decodes a short window
(the tokens since the last release plus the ones before them as context, so a tokenizer's
leading-space rules see what they see in the full text) and holds text back while it ends in an
incomplete UTF-8 character, or while its tail could still become a stop string.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from osfarm.policy.sampling import SamplingParams, finite_logprob

INCOMPLETE = "\ufffd"  # what a decoder yields for the first bytes of a character split across tokens
log = logging.getLogger(__name__)


@dataclass
class ChoiceDelta:
    """What one choice gained in one generation step."""

    index: int
    token_ids: list[int]
    text: str
    logprobs: list[float] | None  # one per token id (None: not requested)
    top_logprobs: list[list[tuple[int, float]]] | None  # per token: (token id, log-prob), best first
    finish_reason: str | None = None  # set on the choice's last delta


class IncrementalText:
    """The text of a token sequence that grows one token at a time, released in deltas."""

    def __init__(self, decode: Callable[[Sequence[int]], str], holdback: int = 0):
        self.decode = decode
        self.holdback = holdback  # chars kept back: the longest stop string's length - 1
        self.ids: list[int] = []
        self.prefix = 0  # first token of the decoding window (context)
        self.read = 0  # tokens whose text is in `text`
        self.text = ""  # the decoded text so far (released or held back)
        self.sent = 0  # chars of `text` released

    def push(self, token_id: int) -> None:
        self.ids.append(token_id)
        before = self.decode(self.ids[self.prefix:self.read])
        window = self.decode(self.ids[self.prefix:])
        if len(window) > len(before) and not window.endswith(INCOMPLETE):
            self.text += window[len(before):]
            self.prefix, self.read = self.read, len(self.ids)

    def release(self) -> str:
        """The text that can no longer change or turn into a stop string, not released before."""
        end = max(self.sent, len(self.text) - self.holdback)
        out, self.sent = self.text[self.sent:end], end
        return out

    def release_final(self, final: str) -> str:
        """The rest of the sequence's ``final`` text (the last delta)."""
        sent = self.text[: self.sent]
        if not final.startswith(sent):  # a tokenizer whose window text differs from its full text
            log.warning("streamed text %r is not a prefix of the final text %r", sent, final)
            return ""
        self.sent = len(self.text)
        return final[len(sent):]


class StepObserver:
    """A stopping criterion for ``generate`` that streams every step (see the module docstring).

    ``rows``: rows of the generated batch; choice ``i`` reads row ``i % rows`` (greedy decoding
    runs once for all ``n`` choices). ``finish(ids) -> (ids, text, finish_reason)`` is the
    engine's own end of a sequence.
    """

    def __init__(self, *, n: int, rows: int, params: SamplingParams, eos_ids: set[int],
                 decode: Callable[[Sequence[int]], str],
                 finish: Callable[[list[int]], tuple[list[int], str, str]],
                 emit: Callable[[list[ChoiceDelta]], None], cancel: threading.Event | None = None):
        self.n, self.rows, self.params, self.eos_ids = n, rows, params, eos_ids
        self.finish, self.emit = finish, emit
        self.cancel = cancel or threading.Event()
        holdback = max((len(s) for s in params.stop), default=1) - 1
        self.texts = [IncrementalText(decode, holdback) for _ in range(n)]
        self.done = [False] * n
        self.raw_logits: Any = None  # raw log-probs mode: the step's logits, from a forward hook

    def record_logits(self, _module: Any, _args: Any, output: Any) -> None:
        """Forward hook of the model (``--logprobs-mode raw``): the logits of the step's tokens."""
        self.raw_logits = output.logits[:, -1].float()

    def __call__(self, input_ids: Any, scores: Any = None, **_kw: Any) -> Any:
        import torch

        stop_all = self.cancel.is_set()
        if not stop_all:
            deltas = self._deltas(input_ids, scores[-1] if scores else self.raw_logits)
            if deltas:
                self.emit(deltas)
        return torch.full((input_ids.shape[0],), stop_all, dtype=torch.bool, device=input_ids.device)

    def _logprobs(self, step: Any, row: int, token: int) -> tuple[float, list[tuple[int, float]]]:
        import torch

        lp = torch.log_softmax(step[row].float(), dim=-1)
        tops: list[tuple[int, float]] = []
        if self.params.top_logprobs:
            vals, idx = torch.topk(lp, k=min(self.params.top_logprobs, lp.shape[-1]))
            tops = [(int(t), finite_logprob(float(v))) for v, t in zip(vals, idx, strict=True)]
        return finite_logprob(float(lp[token])), tops

    def _deltas(self, input_ids: Any, step: Any) -> list[ChoiceDelta]:
        p = self.params
        want_lp = p.logprobs or p.top_logprobs > 0
        scored: dict[int, tuple[float, list[tuple[int, float]]]] = {}
        out = []
        for i in range(self.n):
            if self.done[i]:
                continue
            row = i % self.rows
            token = int(input_ids[row, -1])
            if want_lp and row not in scored:
                scored[row] = self._logprobs(step, row, token)
            text = self.texts[i]
            text.push(token)
            ended = (token in self.eos_ids or len(text.ids) >= p.max_tokens
                     or any(s and s in text.text for s in p.stop))
            reason = None
            if ended:
                ids, final, reason = self.finish(list(text.ids))
                self.done[i] = True
                delta = text.release_final(final)
                kept = len(ids) == len(text.ids)  # the token is part of the answer (always, as checked each step)
            else:
                delta = text.release()
                kept = True
            lp, tops = scored.get(row, (0.0, []))
            out.append(ChoiceDelta(
                index=i, token_ids=[token] if kept else [], text=delta,
                logprobs=([lp] if kept else []) if want_lp else None,
                top_logprobs=([tops] if kept else []) if want_lp else None, finish_reason=reason,
            ))
        return out
