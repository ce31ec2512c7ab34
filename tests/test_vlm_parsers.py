"""Prompt-format parsers on a corpus of model replies (tests/fixtures/model_outputs/<format>/).

Each ``<name>.txt`` is a reply as a model wrote it; ``<name>.json`` holds the expectation
written by hand: ``actions`` (the exact parse) or ``error`` (a part of the ParseError message),
plus the screen, action space and format options of the step. Also the pure geometry, the a11y
linearisation and the history window.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from osfarm.agents.prompts import ParseError, StepContext, make_format
from osfarm.agents.prompts.a11y import HEADER, linearize
from osfarm.agents.prompts.geometry import (
    GeometryError,
    png_size,
    smart_resize,
    to_screen,
)
from osfarm.agents.prompts.messages import (
    OMITTED,
    Turn,
    build_messages,
    restore_images,
    strip_images,
)

CORPUS = Path(__file__).parent / "fixtures" / "model_outputs"
CASES = sorted(CORPUS.glob("*/*.txt"))
SPACE = {"pyautogui": "pyautogui", "computer_13": "computer_13", "uitars": "pyautogui"}


def test_the_corpus_is_big_and_mixed() -> None:
    assert len(CASES) >= 50
    kinds = {p.parent.name for p in CASES}
    assert kinds == {"pyautogui", "computer_13", "uitars"}
    errors = [p for p in CASES if "error" in json.loads(p.with_suffix(".json").read_text())]
    assert len(errors) >= 15  # malformed replies are part of it


@pytest.mark.parametrize("path", CASES, ids=[f"{p.parent.name}/{p.stem}" for p in CASES])
def test_corpus_reply_parses_as_expected(path: Path) -> None:
    exp = json.loads(path.with_suffix(".json").read_text())
    fmt_name = path.parent.name
    fmt = make_format(fmt_name, **exp.get("options", {}))
    ctx = StepContext(screen=tuple(exp["screen"]), action_space=exp.get("action_space", SPACE[fmt_name]))
    reply = path.read_bytes().decode("utf-8")
    if "error" in exp:
        with pytest.raises(ParseError) as e:
            fmt.parse(reply, ctx)
        assert exp["error"] in str(e.value)
    else:
        assert fmt.parse(reply, ctx).actions == exp["actions"]


def test_uitars_thought_is_kept() -> None:
    fmt = make_format("uitars")
    p = fmt.parse("Thought: The icon is at the top.\nIt opens Chrome.\nAction: wait()",
                  StepContext((1920, 1080), "pyautogui"))
    assert p.thought == "The icon is at the top.\nIt opens Chrome." and p.actions == ["WAIT"]


# --- geometry: numbers worked by hand -------------------------------------------------------

@pytest.mark.parametrize(("size", "kw", "want"), [
    ((1920, 1080), {}, (1932, 1092)),  # 1920/28 = 68.57 -> 69*28; 1080/28 = 38.57 -> 39*28
    ((1024, 768), {}, (1036, 756)),  # 36.57 -> 37*28 = 1036; 27.43 -> 27*28 = 756
    ((1280, 720), {}, (1288, 728)),  # 45.71 -> 46*28; 25.71 -> 26*28
    # 1024x768 over a 200704-pixel budget: beta = sqrt(786432/200704) = 1.9795;
    # floor(768/1.9795/28) = 13 -> 364, floor(1024/1.9795/28) = 18 -> 504
    ((1024, 768), {"max_pixels": 200704}, (504, 364)),
    # the tiny policy model's budget: beta = sqrt(921600/200704) = 2.1429; 12*28 = 336, 21*28 = 588
    ((1280, 720), {"max_pixels": 200704}, (588, 336)),
    # 100x50 under 78400 pixels: rounded 112x56 = 6272 < 78400; beta = sqrt(78400/5000) = 3.9598;
    # ceil(50*3.9598/28) = 8 -> 224, ceil(100*3.9598/28) = 15 -> 420
    ((100, 50), {}, (420, 224)),
    ((28, 28), {"min_pixels": 784}, (28, 28)),
])
def test_smart_resize(size: tuple[int, int], kw: dict, want: tuple[int, int]) -> None:
    w, h = smart_resize(*size, **kw)
    assert (w, h) == want and w % 28 == 0 and h % 28 == 0


def test_smart_resize_rejects_absurd_sizes() -> None:
    with pytest.raises(GeometryError, match="aspect ratio"):
        smart_resize(10000, 20)
    with pytest.raises(GeometryError, match="positive"):
        smart_resize(0, 10)


def test_to_screen_maps_and_clamps() -> None:
    assert to_screen(966, 546, (1932, 1092), (1920, 1080)) == (960, 540)
    assert to_screen(0, 0, (1932, 1092), (1920, 1080)) == (0, 0)
    assert to_screen(1932, 1092, (1932, 1092), (1920, 1080)) == (1919, 1079)
    assert to_screen(500, 250, (1000, 1000), (1024, 768)) == (512, 192)


def test_png_size_reads_the_header() -> None:
    import io

    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", (321, 123)).save(buf, "PNG")
    assert png_size(buf.getvalue()) == (321, 123)
    with pytest.raises(GeometryError, match="not a PNG"):
        png_size(b"GIF89a....")


# --- a11y table ---------------------------------------------------------------------------

A11Y = """<desktop-frame xmlns:st="https://accessibility.ubuntu.example.org/ns/state"
 xmlns:cp="https://accessibility.ubuntu.example.org/ns/component"
 xmlns:attr="https://accessibility.ubuntu.example.org/ns/attributes">
 <application name="gedit">
  <frame name="notes.txt - gedit" st:showing="true" cp:screencoord="(0, 0)" cp:size="(1024, 768)">
   <push-button name="Save" st:showing="true" st:visible="true" cp:screencoord="(900, 10)" cp:size="(60, 30)"/>
   <push-button name="Hidden" cp:screencoord="(0, 0)" cp:size="(60, 30)"/>
   <text st:showing="true" cp:screencoord="(0, 50)" cp:size="(1024, 700)">line one
line	two</text>
   <filler st:showing="true" cp:screencoord="(0, 0)" cp:size="(10, 10)"/>
  </frame>
 </application>
</desktop-frame>"""


def test_a11y_table_keeps_visible_named_nodes() -> None:
    lines = linearize(A11Y).splitlines()
    assert lines[0] == HEADER
    assert lines[1].split("\t")[:2] == ["frame", "notes.txt - gedit"]
    assert lines[2].split("\t") == ["push-button", "Save", "", "", "", "(900, 10)", "(60, 30)"]
    assert lines[3].split("\t")[:3] == ["text", "", "line one\\nline two"]
    assert len(lines) == 4  # the hidden button and the anonymous filler are left out


def test_a11y_table_is_clipped_and_survives_bad_xml() -> None:
    clipped = linearize(A11Y, max_chars=len(HEADER) + 60)
    assert clipped.endswith("[... accessibility tree truncated]")
    assert linearize("<desktop-frame><oops") .startswith("(accessibility tree unreadable")
    assert linearize(None) == ""


# --- history window and record images -------------------------------------------------------

def _images(msg: dict) -> int:
    return sum(1 for p in msg["content"] if p.get("type") == "image_url") if isinstance(msg["content"], list) else 0


def test_history_keeps_k_turns_and_m_screenshots() -> None:
    head = [{"role": "system", "content": "sys"}]
    past = [Turn(screenshot=b"png%d" % i, text="", response=f"reply {i}") for i in range(5)]
    cur = Turn(screenshot=b"now", text="")
    msgs = build_messages(head, past, cur, history_turns=3, history_images=2)
    assert [m["role"] for m in msgs] == ["system"] + ["user", "assistant"] * 3 + ["user"]
    assert [m["content"] for m in msgs if m["role"] == "assistant"] == ["reply 2", "reply 3", "reply 4"]
    users = [m for m in msgs if m["role"] == "user"]
    assert [_images(m) for m in users] == [0, 0, 1, 1]  # the last 2 observations (current included)
    assert users[0]["content"] == [{"type": "text", "text": OMITTED}]
    assert build_messages(head, past, cur, history_turns=0, history_images=1)[1:] == [
        {"role": "user", "content": [build_messages([], [], cur, 0, 1)[0]["content"][0]]}]


def test_request_images_become_blob_refs_and_back() -> None:
    store: dict[str, bytes] = {}

    def put(data: bytes, ext: str, media_type: str) -> dict:
        store[str(len(store))] = data
        return {"sha256": "x" * 64, "path": f"blobs/{len(store) - 1}.{ext}", "media_type": media_type,
                "size": len(data)}

    cur = Turn(screenshot=b"\x89PNG fake", text="look")
    msgs = build_messages([{"role": "system", "content": "s"}], [], cur, 1, 1)
    stripped = strip_images(msgs, put)
    assert "data:" not in json.dumps(stripped)
    ref = stripped[1]["content"][1]["image_url"]["blob"]
    assert ref["media_type"] == "image/png" and ref["size"] == len(b"\x89PNG fake")
    back = restore_images(stripped, lambda r: store[r["path"].split("/")[1].split(".")[0]])
    assert back == msgs
