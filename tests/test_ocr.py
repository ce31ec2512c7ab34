"""compare_image_text with the real EasyOCR (the `ocr` extra), offline, as OSWorld's task scores it."""

from __future__ import annotations

import importlib.util
import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw, ImageFont

from osfarm.evaluators.errors import RuleError, UnsupportedOption
from osfarm.evaluators.metrics import METRICS, ocr
from osfarm.evaluators.metrics import docs as docs_m
from osfarm.evaluators.scoring import score
from osfarm.tasks.coverage import coverage

ROOT = Path(__file__).resolve().parents[1]
OSWORLD = ROOT.parent / "shared" / "osworld"
MONO = "/usr/share/fonts/truetype/dejavu/DejaVuSansMono.ttf"
# OSWorld's task 02ce9a50 ("save a screenshot of `ls` in a terminal as ls.png"): any metric of three
OSWORLD_LS = {"func": ["compare_image_text"] * 3, "conj": "or",
              "result": [{"type": "vm_file", "path": "/home/user/Desktop/ls.png", "dest": "ls.png"}] * 3,
              "expected": [{"type": "rule", "rules": {"type": "text", "text": t}} for t in ("ls", "1s", "1s")]}


def terminal_shot(path: Path, lines: list[str]) -> Path:
    """A dark terminal window's worth of monospace text, as a screenshot of one would look."""
    img = Image.new("RGB", (1000, 60 + 40 * len(lines)), (48, 10, 36))
    draw = ImageDraw.Draw(img)
    font = ImageFont.truetype(MONO, 26)
    for i, line in enumerate(lines):
        draw.text((16, 20 + 40 * i), line, fill=(238, 238, 236), font=font)
    img.save(path)
    return path


def write_xwd(path: Path, img: Image.Image) -> Path:
    """An X11 window dump as `xwd` writes it on x86 (XWDFile.h: big-endian header of 25 CARD32,
    the window name, no colormap entries, then 32-bit LSBFirst ZPixmap rows B, G, R, X)."""
    w, h = img.size
    name = b"xwdump\x00"
    header_size = 100 + len(name)
    fields = [header_size, 7, 2, 24, w, h, 0, 0, 32, 0, 32, 32, w * 4, 4, 0xFF0000, 0xFF00, 0xFF, 8, 256, 0,
              w, h, 0, 0, 0]
    rgb = np.asarray(img.convert("RGB"))
    bgrx = np.concatenate([rgb[:, :, ::-1], np.zeros((h, w, 1), np.uint8)], axis=2)
    path.write_bytes(b"".join(f.to_bytes(4, "big") for f in fields) + name + bgrx.tobytes())
    return path


def test_the_extra_is_installed_here_without_torchvision() -> None:
    # `make venv` installs osfarm[all] (ocr included) and easyocr --no-deps: a test machine
    # without them is broken. PyPI's torchvision must stay out: on the CPU torch it does not
    # load, and transformers' image processors fail to import while it is installed.
    assert ocr.ocr_available(), ocr.OCR_MISSING
    assert importlib.util.find_spec("torchvision") is None


def test_the_stand_in_is_gone_after_the_reader_is_built(tmp_path: Path) -> None:
    ocr.image_texts(terminal_shot(tmp_path / "a.png", ["hello"]))
    assert not [m for m in sys.modules if m.split(".")[0] == "torchvision"]
    r = subprocess.run([sys.executable, "-c", "from osfarm.evaluators.metrics import ocr; import sys; "
                        f"ocr.image_texts({str(tmp_path / 'a.png')!r}); "
                        "from transformers import AutoImageProcessor; from transformers.utils import "
                        "is_torchvision_available; print(is_torchvision_available())"],
                       capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0 and r.stdout.strip().endswith("False"), r.stderr[-2000:]


def test_reads_a_terminal_shot_as_osworld_scores_it(tmp_path: Path) -> None:
    ls = terminal_shot(tmp_path / "ls.png", ["user@user-virtual-machine:~$ ls",
                                             "Desktop  Documents  Downloads  Music  Pictures"])
    texts = ocr.image_texts(ls)
    # EasyOCR reads this "ls" as "1s": the reason OSWorld's rule also accepts "1s"
    assert re.search(r"\b[l1]s$", " ".join(texts)) and "Documents" in texts, texts
    assert score(OSWORLD_LS, [str(ls)] * 3, [r["rules"] for r in OSWORLD_LS["expected"]], "DONE", METRICS) == 1.0
    pwd = terminal_shot(tmp_path / "pwd.png", ["user@user-virtual-machine:~$ echo Downloads", "Downloads"])
    assert docs_m.compare_image_text(str(pwd), {"type": "text", "text": "ls"}) == 0.0
    assert docs_m.compare_image_text(str(pwd), {"type": "text", "text": "Downloads"}) == 1.0
    assert score(OSWORLD_LS, [str(pwd)] * 3, [r["rules"] for r in OSWORLD_LS["expected"]], "DONE", METRICS) == 0.0


def test_an_xwd_screen_dump_is_read_too(tmp_path: Path) -> None:
    png = terminal_shot(tmp_path / "t.png", ["user@host:~$ ls", "Videos  Templates"])
    with Image.open(png) as img:
        dump = write_xwd(tmp_path / "ls.png", img)  # an agent may save `xwd` output under any name
    assert docs_m.compare_image_text(str(dump), {"type": "text", "text": "Templates"}) == 1.0
    assert not list(Path("/tmp").glob("osfarm-xwd-*.png"))  # the converted copy is removed


def test_missing_or_bad_images_score_zero_and_bad_rules_raise(tmp_path: Path) -> None:
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG not really")
    for bad in (None, "", str(tmp_path / "missing.png"), str(junk), str(tmp_path)):
        assert docs_m.compare_image_text(bad, {"type": "text", "text": "ls"}) == 0.0
    for rule in ({"type": "regex", "text": "ls"}, {"type": "text"}, "ls", None):
        with pytest.raises(RuleError, match="rule must be"):
            docs_m.compare_image_text(str(junk), rule)  # type: ignore[arg-type]


def test_without_the_extra_it_is_unsupported_not_scored(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    shot = str(terminal_shot(tmp_path / "ls.png", ["$ ls"]))
    monkeypatch.setitem(sys.modules, "easyocr", None)  # how Python marks a module as not importable
    assert not ocr.ocr_available()
    with pytest.raises(UnsupportedOption, match=r"pip install 'osfarm\[ocr\]' && pip install --no-deps easyocr"):
        docs_m.compare_image_text(shot, {"type": "text", "text": "ls"})
    cov = coverage(OSWORLD / "test_all_index.tsv")
    need = cov.get("metric", "compare_image_text")
    assert need.status == "unsupported" and "install osfarm[ocr]" in (need.reason or "")
    monkeypatch.undo()
    assert coverage(OSWORLD / "test_all_index.tsv").get("metric", "compare_image_text").status == "implemented"


def test_the_weights_load_without_network_and_are_easyocrs_own(tmp_path: Path) -> None:
    # In a network namespace with no interface at all: a download attempt could only fail.
    shot = terminal_shot(tmp_path / "ls.png", ["user@host:~$ ls", "Desktop  Music"])
    script = textwrap.dedent(f"""
        import hashlib, json, os, socket
        from osfarm.evaluators.metrics import ocr
        try:
            socket.create_connection(("huggingface.co", 443), timeout=3)
            online = True
        except OSError:
            online = False
        texts = ocr.image_texts({str(shot)!r})
        import easyocr.config as c, easyocr_en_models as m
        md5 = {{n: hashlib.md5(open(os.path.join(m.model_dir(), n), "rb").read()).hexdigest()
               for n in ("craft_mlt_25k.pth", "english_g2.pth")}}
        print(json.dumps({{"online": online, "texts": texts, "md5": md5,
                          "expected": [c.detection_models["craft"]["md5sum"],
                                       c.recognition_models["gen2"]["english_g2"]["md5sum"]]}}))
    """)
    r = subprocess.run(["unshare", "-rn", sys.executable, "-c", script], capture_output=True, text=True,
                       timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-3000:]
    got = json.loads(r.stdout.strip().splitlines()[-1])
    assert got["online"] is False
    assert re.search(r"\b[l1]s\b", " ".join(got["texts"])) and "Desktop" in got["texts"], got["texts"]
    assert list(got["md5"].values()) == got["expected"]  # the weights EasyOCR itself would download
