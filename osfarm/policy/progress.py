"""transformers' and huggingface_hub's progress bars off while osfarm loads or saves a model.

Their tqdm bars ("Loading weights", "Writing model shards") write to the terminal on their own,
through osfarm's rich output (the trainer's rows, a spinner); osfarm says what it is doing itself.
The switch is a global of those libraries: it is turned off while at least one osfarm load or
save runs (in any thread) and put back as it was after the last one, so a program that uses
osfarm as a library keeps its own bars elsewhere.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager

_lock = threading.Lock()
_depth = 0
_was_enabled = False


@contextmanager
def hf_progress_bars_off() -> Iterator[None]:
    """Within: no transformers / huggingface_hub progress bars (needs transformers installed)."""
    from transformers.utils import logging as hf_logging

    global _depth, _was_enabled
    with _lock:
        if _depth == 0:
            _was_enabled = hf_logging.is_progress_bar_enabled()
            hf_logging.disable_progress_bar()  # huggingface_hub's bars too
        _depth += 1
    try:
        yield
    finally:
        with _lock:
            _depth -= 1
            if _depth == 0 and _was_enabled:
                hf_logging.enable_progress_bar()
