"""OSWorld's image, VLC, audio/video and file-format metrics: one passing and one failing case
each, on files built in tmp_path (Pillow images, wave/ffmpeg audio and video, zip/epub, a tiny
hand-written PDF)."""

from __future__ import annotations

import math
import shutil
import struct
import subprocess
import wave
import zipfile
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageDraw

from osfarm.evaluators.errors import UnsupportedOption
from osfarm.evaluators.metrics import METRICS
from osfarm.evaluators.metrics import archives as archives_m
from osfarm.evaluators.metrics import audio_video as av_m
from osfarm.evaluators.metrics import chrome as chrome_m
from osfarm.evaluators.metrics import gimp as gimp_m
from osfarm.evaluators.metrics import pdf as pdf_m
from osfarm.evaluators.metrics import ssim as ssim_m
from osfarm.evaluators.metrics import vlc as vlc_m

FFMPEG = shutil.which("ffmpeg")  # a system package (scripts/system-packages.txt): never skipped


def test_ffmpeg_is_installed() -> None:
    assert FFMPEG is not None, "ffmpeg is missing: run scripts/setup-system.sh"


def scene(size: tuple[int, int] = (64, 48), shift: int = 0) -> Image.Image:
    """A structured RGB picture: gradient background, a few shapes."""
    w, h = size
    x = np.linspace(0, 1, w)[None, :]
    y = np.linspace(0, 1, h)[:, None]
    arr = np.stack([120 + 80 * x + 0 * y, 60 + 100 * y + 0 * x, 90 + 40 * x * y], axis=2)
    img = Image.fromarray(arr.astype(np.uint8), "RGB")
    d = ImageDraw.Draw(img)
    d.rectangle([5 + shift, 5, 25 + shift, 20], fill=(200, 30, 30))
    d.ellipse([w // 2, h // 2, w - 4, h - 4], fill=(20, 40, 200))
    d.line([0, h - 1, w - 1, 0], fill=(250, 250, 250), width=2)
    return img


def save(img: Image.Image, tmp_path: Path, name: str, **kw: object) -> str:
    p = tmp_path / name
    img.save(p, **kw)
    return str(p)


def noise(size: tuple[int, int], seed: int) -> Image.Image:
    arr = np.random.RandomState(seed).randint(0, 256, (size[1], size[0], 3)).astype(np.uint8)
    return Image.fromarray(arr, "RGB")


# --------------------------------------------------------------------------- SSIM itself


def test_ssim_basics() -> None:
    a = np.asarray(scene())
    assert ssim_m.ssim(a, a) == pytest.approx(1.0)
    b = np.asarray(noise((64, 48), 1))
    assert ssim_m.ssim(a, b) < 0.3
    # Brightness shift lowers SSIM but keeps it high; a constant image vs itself is 1.
    assert 0.8 < ssim_m.ssim(a, np.clip(a.astype(int) + 10, 0, 255).astype(np.uint8)) < 1.0
    flat = np.full((10, 10), 7, np.uint8)
    assert ssim_m.ssim(flat, flat) == pytest.approx(1.0)
    with pytest.raises(ValueError):
        ssim_m.ssim(np.zeros((5, 5)), np.zeros((5, 5)))


# --------------------------------------------------------------------------- images


def test_compare_images(tmp_path: Path) -> None:
    a = save(scene(), tmp_path, "a.png")
    a_big = save(scene().resize((128, 96)), tmp_path, "a_big.png")
    n = save(noise((64, 48), 3), tmp_path, "n.png")
    assert gimp_m.compare_images(a, a) == pytest.approx(1.0)
    assert gimp_m.compare_images(a, a_big) > 0.8
    assert gimp_m.compare_images(a, n) < 0.3
    assert gimp_m.compare_images(a, a, reference_base_result=0.5) == pytest.approx(1.0)
    assert gimp_m.compare_images(a, n, reference_base_result=0.5) == 0.0
    assert gimp_m.compare_images(None, a) == 0.0
    assert gimp_m.compare_images(str(tmp_path / "missing.png"), a) == 0.0
    (tmp_path / "bad.png").write_bytes(b"not a png")
    assert gimp_m.compare_images(str(tmp_path / "bad.png"), a) == 0.0


def test_compare_image_list(tmp_path: Path) -> None:
    a = save(scene(), tmp_path, "a.png")
    a2 = save(scene(), tmp_path, "a2.png")
    b = save(scene(shift=3), tmp_path, "b.png")
    assert gimp_m.compare_image_list(a, a2) == 1.0
    assert gimp_m.compare_image_list([a, a], [a2, a2]) == 1.0
    assert gimp_m.compare_image_list([a, b], [a2, a2]) == 0.0
    assert gimp_m.compare_image_list(None, a) == 0.0
    assert gimp_m.compare_image_list([a, None], [a2, a2]) == 0.0


def test_check_structure_sim(tmp_path: Path) -> None:
    a = save(scene(), tmp_path, "a.png")
    a_jpg = save(scene(), tmp_path, "a.jpg", quality=98, subsampling=0)
    n = save(noise((64, 48), 3), tmp_path, "n.png")
    other_size = save(scene((60, 48)), tmp_path, "s.png")
    assert gimp_m.check_structure_sim(a, a_jpg) == 1.0
    assert gimp_m.check_structure_sim(a, n) == 0.0
    assert gimp_m.check_structure_sim(a, other_size) == 0.0
    assert gimp_m.check_structure_sim(None, a) == 0.0
    assert gimp_m.check_structure_sim(str(tmp_path / "x.png"), a) == 0.0


def test_check_structure_sim_with_threshold(tmp_path: Path) -> None:
    a = save(scene(), tmp_path, "a.png")
    big = save(scene().resize((128, 96), Image.Resampling.LANCZOS), tmp_path, "big.png")
    shifted = save(scene(shift=10), tmp_path, "b.png")
    assert gimp_m.check_structure_sim_with_threshold(big, a) == 1.0  # resized to the target first
    assert gimp_m.check_structure_sim_with_threshold(shifted, a, ssim_threshold=0.99) == 0.0
    assert gimp_m.check_structure_sim_with_threshold(None, a) == 0.0


def test_check_structure_sim_resized(tmp_path: Path) -> None:
    tgt_img = scene((64, 48))
    tgt = save(tgt_img, tmp_path, "tgt.png")
    # The agent's export: the same picture, larger, on a transparent canvas.
    canvas = Image.new("RGBA", (160, 120), (0, 0, 0, 0))
    canvas.paste(tgt_img.resize((128, 96), Image.Resampling.LANCZOS).convert("RGBA"), (16, 12))
    src = save(canvas, tmp_path, "src.png")
    assert gimp_m.check_structure_sim_resized(src, tgt) == 1.0
    assert gimp_m.check_structure_sim_resized(save(noise((128, 96), 4), tmp_path, "n.png"), tgt) == 0.0
    empty = save(Image.new("RGBA", (20, 20), (0, 0, 0, 0)), tmp_path, "empty.png")
    assert gimp_m.check_structure_sim_resized(empty, tgt) == 0.0
    assert gimp_m.check_structure_sim_resized(None, tgt) == 0.0


def test_check_brightness_decrease_and_structure_sim(tmp_path: Path) -> None:
    orig = scene()
    tgt = save(orig, tmp_path, "orig.png")
    darker = save(orig.point(lambda v: int(v * 0.7)), tmp_path, "dark.png")
    brighter = save(orig.point(lambda v: min(255, int(v * 1.2))), tmp_path, "bright.png")
    assert gimp_m.check_brightness_decrease_and_structure_sim(darker, tgt) == 1.0
    assert gimp_m.check_brightness_decrease_and_structure_sim(brighter, tgt) == 0.0
    dark_noise = save(noise((64, 48), 5).point(lambda v: v // 3), tmp_path, "dn.png")
    assert gimp_m.check_brightness_decrease_and_structure_sim(dark_noise, tgt) == 0.0
    assert gimp_m.check_brightness_decrease_and_structure_sim(None, tgt) == 0.0


def _saturate(img: Image.Image, factor: float) -> Image.Image:
    """Scale HSV saturation, keeping hue and value (as GIMP's Hue-Saturation tool does)."""
    h, s, v = img.convert("HSV").split()
    s = s.point(lambda x: min(255, int(x * factor)))
    return Image.merge("HSV", (h, s, v)).convert("RGB")


def test_check_saturation_increase_and_structure_sim(tmp_path: Path) -> None:
    orig = scene()
    tgt = save(orig, tmp_path, "orig.png")
    more = save(_saturate(orig, 1.5), tmp_path, "more.png")
    less = save(_saturate(orig, 0.5), tmp_path, "less.png")
    assert gimp_m.check_saturation_increase_and_structure_sim(more, tgt) == 1.0
    assert gimp_m.check_saturation_increase_and_structure_sim(less, tgt) == 0.0
    assert gimp_m.check_saturation_increase_and_structure_sim(tgt, None) == 0.0


def test_check_contrast_increase_and_structure_sim(tmp_path: Path) -> None:
    from PIL import ImageEnhance

    orig = scene()
    tgt = save(orig, tmp_path, "orig.png")
    more = save(ImageEnhance.Contrast(orig).enhance(1.4), tmp_path, "more.png")
    less = save(ImageEnhance.Contrast(orig).enhance(0.6), tmp_path, "less.png")
    assert gimp_m.check_contrast_increase_and_structure_sim(more, tgt) == 1.0
    assert gimp_m.check_contrast_increase_and_structure_sim(less, tgt) == 0.0
    assert gimp_m.check_contrast_increase_and_structure_sim(None, tgt) == 0.0


def test_check_image_size(tmp_path: Path) -> None:
    p = save(scene((64, 48)), tmp_path, "a.png")
    assert gimp_m.check_image_size(p, {"width": 64, "height": 48}) == 1.0
    assert gimp_m.check_image_size(p, {"width": 64}) == 1.0
    assert gimp_m.check_image_size(p, {"height": 50}) == 0.0
    canvas = Image.new("RGBA", (100, 80), (0, 0, 0, 0))
    canvas.paste(scene((64, 48)).convert("RGBA"), (10, 10))
    c = save(canvas, tmp_path, "c.png")
    assert gimp_m.check_image_size(c, {"width": 64, "height": 48, "ignore_transparent": True}) == 1.0
    assert gimp_m.check_image_size(c, {"width": 64, "height": 48}) == 0.0
    assert gimp_m.check_image_size(None, {"width": 64}) == 0.0


def test_check_image_file_size(tmp_path: Path) -> None:
    p = save(scene(), tmp_path, "a.png")
    assert gimp_m.check_image_file_size(p, {"max_size": 500 * 1024}) == 1.0
    assert gimp_m.check_image_file_size(p, {"max_size": 100}) == 0.0
    assert gimp_m.check_image_file_size(None, {"max_size": 100}) == 0.0
    assert gimp_m.check_image_file_size(str(tmp_path / "none.png"), {"max_size": 10**9}) == 0.0


def test_check_palette_and_structure_sim(tmp_path: Path) -> None:
    orig = scene()
    tgt = save(orig, tmp_path, "orig.png")
    indexed = save(orig.convert("P", palette=Image.Palette.ADAPTIVE, colors=256), tmp_path, "p.png")
    assert gimp_m.check_palette_and_structure_sim(indexed, tgt) == 1.0
    assert gimp_m.check_palette_and_structure_sim(tgt, tgt) == 0.0  # RGB, not indexed
    assert gimp_m.check_palette_and_structure_sim(None, tgt) == 0.0


def test_check_image_mirror(tmp_path: Path) -> None:
    orig = scene()
    src = save(orig, tmp_path, "orig.png")
    mirrored = save(orig.transpose(Image.Transpose.FLIP_LEFT_RIGHT), tmp_path, "mirror.png")
    flipped = save(orig.transpose(Image.Transpose.FLIP_TOP_BOTTOM), tmp_path, "flip.png")
    assert gimp_m.check_image_mirror(src, mirrored) == 1.0
    assert gimp_m.check_image_mirror(src, flipped) == 0.0
    assert gimp_m.check_image_mirror(src, None) == 0.0


def test_check_green_background(tmp_path: Path) -> None:
    # tgt: black subject on a white background; src must be green wherever tgt is not black.
    tgt_img = Image.new("RGB", (40, 30), (255, 255, 255))
    ImageDraw.Draw(tgt_img).rectangle([10, 8, 25, 20], fill=(0, 0, 0))
    tgt = save(tgt_img, tmp_path, "tgt.png")
    good = Image.new("RGB", (40, 30), (20, 200, 30))
    ImageDraw.Draw(good).rectangle([10, 8, 25, 20], fill=(0, 0, 0))
    bad = Image.new("RGB", (40, 30), (20, 200, 30))
    ImageDraw.Draw(bad).rectangle([0, 0, 5, 5], fill=(200, 20, 30))
    assert gimp_m.check_green_background(save(good, tmp_path, "good.png"), tgt) == 1.0
    assert gimp_m.check_green_background(save(bad, tmp_path, "bad.png"), tgt) == 0.0
    assert gimp_m.check_green_background(None, tgt) == 0.0


def test_check_file_exists_and_structure_sim(tmp_path: Path) -> None:
    tgt = save(scene(), tmp_path, "tgt.png")
    exported = save(scene(), tmp_path, "export.jpg", quality=98, subsampling=0)
    assert gimp_m.check_file_exists_and_structure_sim(exported, tgt) == 1.0
    assert gimp_m.check_file_exists_and_structure_sim(str(tmp_path / "nope.jpg"), tgt) == 0.0
    assert gimp_m.check_file_exists_and_structure_sim(save(noise((64, 48), 9), tmp_path, "n.png"), tgt) == 0.0
    assert gimp_m.check_file_exists_and_structure_sim(None, tgt) == 0.0


def _triangle(center: tuple[int, int]) -> Image.Image:
    img = Image.new("RGB", (100, 100), (255, 255, 255))
    cx, cy = center
    ImageDraw.Draw(img).polygon([(cx, cy - 10), (cx - 10, cy + 6), (cx + 10, cy + 6)], fill=(250, 220, 0))
    return img


def test_check_triangle_position(tmp_path: Path) -> None:
    assert gimp_m.check_triangle_position(save(_triangle((50, 52)), tmp_path, "mid.png")) == 1.0
    assert gimp_m.check_triangle_position(save(_triangle((15, 15)), tmp_path, "corner.png")) == 0.0
    assert gimp_m.check_triangle_position(save(Image.new("RGB", (20, 20)), tmp_path, "flat.png")) == 0.0
    assert gimp_m.check_triangle_position(None) == 0.0


# --------------------------------------------------------------------------- VLC


STATUS = """<?xml version="1.0" encoding="utf-8" standalone="yes" ?>
<root><fullscreen>false</fullscreen><state>{state}</state>
<information><category name="meta"><info name="filename">{name}</info></category></information>
</root>"""


def test_is_vlc_playing(tmp_path: Path) -> None:
    def status(state: str, name: str) -> str:
        p = tmp_path / f"{state}_{abs(hash(name))}.xml"
        p.write_text(STATUS.format(state=state, name=name))
        return str(p)

    rule = {"type": "file_name", "file_name": "song.mp3"}
    assert vlc_m.is_vlc_playing(status("playing", "song.mp3"), rule) == 1.0
    assert vlc_m.is_vlc_playing(status("playing", "/home/user/Music/song.mp3"), rule) == 1.0
    assert vlc_m.is_vlc_playing(status("paused", "song.mp3"), rule) == 0.0
    assert vlc_m.is_vlc_playing(status("playing", "other.mp3"), rule) == 0.0
    url_rule = {"type": "url", "url": "https://example.com/live/stream.m3u8"}
    assert vlc_m.is_vlc_playing(status("playing", "stream.m3u8"), url_rule) == 1.0
    assert vlc_m.is_vlc_playing(status("playing", "https://other.org/x.m3u8"), url_rule) == 0.0
    assert vlc_m.is_vlc_playing(None, rule) == 0.0
    (tmp_path / "bad.xml").write_text("<root><state>")
    assert vlc_m.is_vlc_playing(str(tmp_path / "bad.xml"), rule) == 0.0
    with pytest.raises(UnsupportedOption):
        vlc_m.is_vlc_playing(status("playing", "song.mp3"), {"type": "nonsense"})


def test_is_vlc_fullscreen() -> None:
    screen = {"width": 1920, "height": 1080}
    assert vlc_m.is_vlc_fullscreen({"width": 1920, "height": 1080}, screen) == 1.0
    assert vlc_m.is_vlc_fullscreen({"width": 1280, "height": 720}, screen) == 0.0
    assert vlc_m.is_vlc_fullscreen(None, screen) == 0.0
    assert vlc_m.is_vlc_fullscreen({"width": 1920, "height": 1080}, None) == 0.0


VLCRC = """\
# VLC media player preferences
[qt] # Qt interface
#qt-bgcone=1
qt-minimal-view=1
qt-max-volume=200
#qt-slider-colours=153;210;153;20;210;20;255;199;15;245;39;29
qt-slider-colours=10;20;30;0;0;0;50;50;50;99;99;99
[core]
input-record-path=/home/user/Desktop
global-key-play-pause=Ctrl+p
#play-and-exit=0
one-instance-when-started-from-file=0
"""


def test_vlcrc_checks(tmp_path: Path) -> None:
    rc = tmp_path / "vlcrc"
    rc.write_text(VLCRC)
    p = str(rc)
    assert vlc_m.is_vlc_recordings_folder(p, {"recording_file_path": "/home/user/Desktop"}) == 1.0
    assert vlc_m.is_vlc_recordings_folder(p, {"recording_file_path": "/home/user/Videos"}) == 0.0
    assert vlc_m.check_qt_bgcone(p, {"expected_qt_bgcone": 1}) == 1.0  # default (commented out)
    assert vlc_m.check_qt_bgcone(p, {"expected_qt_bgcone": 0}) == 0.0
    assert vlc_m.check_qt_max_volume(p, {"expected_qt_max_volume": 200}) == 1.0
    assert vlc_m.check_qt_max_volume(p, {"expected_qt_max_volume": 125}) == 0.0
    assert vlc_m.check_qt_minimal_view(p, {"expected_qt_minimal_view": 1}) == 1.0
    assert vlc_m.check_qt_minimal_view(p, {"expected_qt_minimal_view": "0"}) == 0.0
    assert vlc_m.check_qt_slider_colours(p, {"type": "blackish"}) == 1.0
    assert vlc_m.check_qt_slider_colours(p, {"type": "match", "expected_qt_slider_colours": "1;2;3"}) == 0.0
    assert vlc_m.check_global_key_play_pause(p, {"expected_global_key_play_pause": 1}) == 1.0
    assert vlc_m.check_global_key_play_pause(p, {"expected_global_key_play_pause": 0}) == 0.0
    check = vlc_m.check_one_instance_when_started_from_file
    assert check(p, {"expected_one_instance_when_started_from_file": 0}) == 1.0
    assert check(p, {"expected_one_instance_when_started_from_file": 1}) == 0.0
    assert vlc_m.check_play_and_exit(p, {"expected_play_and_exit": 0}) == 1.0
    assert vlc_m.check_play_and_exit(p, {"expected_play_and_exit": 1}) == 0.0
    default_rc = tmp_path / "vlcrc2"
    default_rc.write_text("[qt]\n#qt-slider-colours=153;210;153;20;210;20;255;199;15;245;39;29\n")
    assert vlc_m.check_qt_slider_colours(str(default_rc), {"type": "blackish"}) == 0.0
    for func, rule in [
        (vlc_m.is_vlc_recordings_folder, {"recording_file_path": "/x"}),
        (vlc_m.check_qt_bgcone, {"expected_qt_bgcone": 1}),
        (vlc_m.check_qt_max_volume, {"expected_qt_max_volume": 125}),
        (vlc_m.check_qt_minimal_view, {"expected_qt_minimal_view": 0}),
        (vlc_m.check_qt_slider_colours, {"type": "blackish"}),
        (vlc_m.check_global_key_play_pause, {"expected_global_key_play_pause": 0}),
        (vlc_m.check_one_instance_when_started_from_file, {"expected_one_instance_when_started_from_file": 1}),
        (vlc_m.check_play_and_exit, {"expected_play_and_exit": 0}),
    ]:
        assert func(None, rule) == 0.0, func.__name__
        assert func(str(tmp_path / "missing"), rule) == 0.0, func.__name__


# --------------------------------------------------------------------------- audio / video


def write_wav(path: Path, freqs: list[float], seconds: float = 1.0, rate: int = 16000) -> str:
    n = int(seconds * rate)
    t = np.arange(n) / rate
    # A melody: the frequencies one after another.
    seg = n // len(freqs)
    y = np.concatenate([np.sin(2 * math.pi * f * t[:seg]) for f in freqs])
    with wave.open(str(path), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(b"".join(struct.pack("<h", int(v * 12000)) for v in y))
    return str(path)


def test_compare_audios(tmp_path: Path) -> None:
    a = write_wav(tmp_path / "a.wav", [440, 660, 880, 550])
    a2 = write_wav(tmp_path / "a2.wav", [440, 660, 880, 550])
    rng = np.random.RandomState(0)
    with wave.open(str(tmp_path / "noise.wav"), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(16000)
        w.writeframes((rng.randn(16000) * 8000).astype("<i2").tobytes())
    same = av_m.compare_audios(a, a2)
    other = av_m.compare_audios(a, str(tmp_path / "noise.wav"))
    assert same == pytest.approx(1.0, abs=1e-6)
    assert other < 0.9 and other < same
    assert av_m.compare_audios(None, a) == 0.0
    assert av_m.compare_audios(str(tmp_path / "missing.wav"), a) == 0.0
    (tmp_path / "bad.wav").write_bytes(b"RIFF garbage")
    assert av_m.compare_audios(str(tmp_path / "bad.wav"), a) == 0.0


def make_mp3(tmp_path: Path, name: str) -> str:
    wav = write_wav(tmp_path / f"{name}.wav", [440], seconds=0.5)
    out = tmp_path / f"{name}.mp3"
    subprocess.run([FFMPEG, "-nostdin", "-v", "error", "-y", "-i", wav, "-codec:a", "libmp3lame", str(out)], check=True)
    return str(out)


def test_check_mp3_meta(tmp_path: Path) -> None:
    from mutagen.easyid3 import EasyID3
    from mutagen.id3 import ID3NoHeaderError

    p = make_mp3(tmp_path, "song")
    try:
        tags = EasyID3(p)
    except ID3NoHeaderError:
        tags = EasyID3()
    tags["title"] = "Moonlight"
    tags["artist"] = ["Ada", "Bob"]
    tags.save(p)
    meta = {"title": {"method": "eq", "ref": "Moonlight"}, "artist": {"method": "eq", "ref": "Ada,Bob"}}
    assert av_m.check_mp3_meta(p, meta) == 1.0
    assert av_m.check_mp3_meta(p, {"title": {"method": "eq", "ref": "Sunlight"}}) == 0.0
    assert av_m.check_mp3_meta(p, {"album": {"method": "eq", "ref": ""}}) == 1.0  # absent tag = ""
    assert av_m.check_mp3_meta(None, meta) == 0.0
    untagged = make_mp3(tmp_path, "plain")
    assert av_m.check_mp3_meta(untagged, meta) == 0.0  # no ID3 header


def make_video(tmp_path: Path, name: str, source: str, seconds: float = 1.0) -> str:
    out = tmp_path / name
    subprocess.run(
        [FFMPEG, "-nostdin", "-v", "error", "-y", "-f", "lavfi",
         "-i", f"{source}=size=64x48:rate=10:duration={seconds}",
         "-c:v", "mpeg4", "-q:v", "3", str(out)],
        check=True,
    )
    return str(out)


def test_compare_videos(tmp_path: Path) -> None:
    a = make_video(tmp_path, "a.mp4", "testsrc")
    a2 = make_video(tmp_path, "a2.mp4", "testsrc")
    shorter = make_video(tmp_path, "short.mp4", "testsrc", seconds=0.5)
    other = make_video(tmp_path, "b.mp4", "smptebars")
    assert av_m.compare_videos(a, a2) == 1.0
    assert av_m.compare_videos(a, shorter) == 0.0
    assert av_m.compare_videos(a, other) == 0.0
    assert av_m.compare_videos(None, a) == 0.0


# --------------------------------------------------------------------------- PDF


def make_pdf(path: Path, pages: list[str]) -> str:
    """A minimal valid PDF: one Helvetica text line per page."""
    objs: list[bytes] = []
    n = len(pages)
    kids = " ".join(f"{4 + 2 * i} 0 R" for i in range(n))
    objs.append(b"<< /Type /Catalog /Pages 2 0 R >>")
    objs.append(f"<< /Type /Pages /Kids [{kids}] /Count {n} >>".encode())
    objs.append(b"<< /Type /Font /Subtype /Type1 /BaseFont /Helvetica >>")
    for i, text in enumerate(pages):
        esc = text.replace("\\", "\\\\").replace("(", "\\(").replace(")", "\\)")
        stream = f"BT /F1 12 Tf 72 720 Td ({esc}) Tj ET".encode()
        objs.append(
            f"<< /Type /Page /Parent 2 0 R /MediaBox [0 0 612 792] /Resources << /Font << /F1 3 0 R >> >> "
            f"/Contents {5 + 2 * i} 0 R >>".encode()
        )
        objs.append(b"<< /Length %d >>\nstream\n" % len(stream) + stream + b"\nendstream")
    out = bytearray(b"%PDF-1.4\n")
    offsets = []
    for i, body in enumerate(objs, 1):
        offsets.append(len(out))
        out += b"%d 0 obj\n" % i + body + b"\nendobj\n"
    xref = len(out)
    out += b"xref\n0 %d\n0000000000 65535 f \n" % (len(objs) + 1)
    for off in offsets:
        out += b"%010d 00000 n \n" % off
    out += b"trailer\n<< /Size %d /Root 1 0 R >>\nstartxref\n%d\n%%%%EOF\n" % (len(objs) + 1, xref)
    path.write_bytes(bytes(out))
    return str(path)


def test_compare_pdfs(tmp_path: Path) -> None:
    a = make_pdf(tmp_path / "a.pdf", ["Hello world", "Second page"])
    a2 = make_pdf(tmp_path / "a2.pdf", ["Hello world", "Second page"])
    b = make_pdf(tmp_path / "b.pdf", ["Quarterly revenue report", "Totally different"])
    assert pdf_m.compare_pdfs(a, a2) == pytest.approx(1.0)
    assert pdf_m.compare_pdfs(a, b) < 0.5
    assert pdf_m.compare_pdfs([a, a], [a2, b]) == pytest.approx((1.0 + pdf_m.compare_pdfs(a, b)) / 2)
    assert pdf_m.compare_pdfs(None, a) == 0.0
    (tmp_path / "bad.pdf").write_bytes(b"%PDF-1.4 garbage")
    assert pdf_m.compare_pdfs(str(tmp_path / "bad.pdf"), a) == 0.0


def test_check_pdf_pages(tmp_path: Path) -> None:
    p = make_pdf(tmp_path / "a.pdf", ["one", "two", "three"])
    assert pdf_m.check_pdf_pages(p, {"relation": "eq", "ref_value": 3}) == 1.0
    assert pdf_m.check_pdf_pages(p, {"relation": "lt", "ref_value": 3}) == 0.0
    assert pdf_m.check_pdf_pages(None, {"relation": "eq", "ref_value": 3}) == 0.0


# --------------------------------------------------------------------------- archives, epub, html


def make_zip(path: Path, members: dict[str, bytes]) -> str:
    with zipfile.ZipFile(path, "w") as z:
        for name, data in members.items():
            z.writestr(name, data)
    return str(path)


def test_compare_archive(tmp_path: Path) -> None:
    gold = make_zip(tmp_path / "gold.zip", {"a.txt": b"alpha\n", "b.txt": b"beta\n"})
    same = make_zip(tmp_path / "same.zip", {"b.txt": b"beta\n", "a.txt": b"alpha\n"})
    half = make_zip(tmp_path / "half.zip", {"a.txt": b"alpha\n", "b.txt": b"BETA\n"})
    names = make_zip(tmp_path / "names.zip", {"a.txt": b"alpha\n", "c.txt": b"beta\n"})
    assert archives_m.compare_archive(same, gold) == 1.0
    assert archives_m.compare_archive(half, gold) == 0.5
    assert archives_m.compare_archive(half, gold, ignore_case=True) == 1.0  # options reach compare_text_file
    assert archives_m.compare_archive(names, gold) == 0.0
    nested_gold = make_zip(tmp_path / "ng.zip", {"docs/a.pdf": b"", "docs/": b""})
    with zipfile.ZipFile(nested_gold, "w") as z:
        z.writestr("docs/a.pdf", Path(make_pdf(tmp_path / "p.pdf", ["Report"])).read_bytes())
    nested_pred = tmp_path / "np.zip"
    shutil.copy(nested_gold, nested_pred)
    assert archives_m.compare_archive(str(nested_pred), nested_gold, file_path="docs", file_type="pdf") == 1.0
    assert archives_m.compare_archive(None, gold) == 0.0
    (tmp_path / "bad.zip").write_bytes(b"PK not really")
    assert archives_m.compare_archive(str(tmp_path / "bad.zip"), gold) == 0.0
    with pytest.raises(UnsupportedOption):
        archives_m.compare_archive(same, gold, file_type="hologram")


def test_compare_zip_files(tmp_path: Path) -> None:
    pdf = Path(make_pdf(tmp_path / "p.pdf", ["Invoice 42"])).read_bytes()
    pdf_other = Path(make_pdf(tmp_path / "q.pdf", ["Something else entirely"])).read_bytes()
    gold = make_zip(tmp_path / "gold.zip", {"x.txt": b"x", "r.pdf": pdf})
    same = make_zip(tmp_path / "same.zip", {"r.pdf": pdf, "x.txt": b"x"})
    diff = make_zip(tmp_path / "diff.zip", {"x.txt": b"x", "r.pdf": pdf_other})
    diff_txt = make_zip(tmp_path / "difft.zip", {"x.txt": b"y", "r.pdf": pdf})
    assert archives_m.compare_zip_files(same, gold) == 1.0
    assert archives_m.compare_zip_files(diff, gold) == 0.0
    assert archives_m.compare_zip_files(diff_txt, gold) == 0.0
    assert archives_m.compare_zip_files(None, gold) == 0.0


def make_epub(path: Path, chapters: dict[str, str], ident: str) -> str:
    toc = "<ncx>\n<navMap>\n"
    toc += "".join(f'<navPoint id="{n}"><content src="{n}"/></navPoint>\n' for n in chapters) + "</navMap>\n</ncx>\n"
    opf = (f"<package>\n<metadata>\n<dc:identifier>{ident}</dc:identifier>\n<dc:title>Book</dc:title>\n"
           "</metadata>\n</package>\n")
    members = {"mimetype": b"application/epub+zip", "toc.ncx": toc.encode(), "content.opf": opf.encode()}
    for name, body in chapters.items():
        members[name] = f"<html><body>\n{body}\n</body></html>".encode()
    return make_zip(path, members)


def test_compare_epub(tmp_path: Path) -> None:
    chapters = {"ch1.html": "<p>Call me Ishmael.</p><p>Some years ago.</p>", "ch2.html": "<p>The Carpet-Bag.</p>"}
    gold = make_epub(tmp_path / "gold.epub", chapters, "uuid-1")
    same = make_epub(tmp_path / "same.epub", chapters, "uuid-2")  # identifiers are ignored
    other = make_epub(
        tmp_path / "other.epub",
        {"ch1.html": "<h1>Chapter</h1><div>Entirely new text.</div><ul><li>x</li></ul>", "ch2.html": "<p>Nope.</p>"},
        "uuid-3",
    )
    assert archives_m.compare_epub(same, gold) == pytest.approx(1.0)
    assert archives_m.compare_epub(other, gold) < 0.9
    assert archives_m.compare_epub(None, gold) == 0.0
    not_epub = make_zip(tmp_path / "x.epub", {"a.txt": b"a"})
    assert archives_m.compare_epub(not_epub, gold) == 0.0


def test_compare_htmls(tmp_path: Path) -> None:
    def html(name: str, body: str) -> str:
        p = tmp_path / name
        p.write_text(f"<html><head><title>T</title></head><body>{body}</body></html>", encoding="utf-8")
        return str(p)

    gold = html("gold.html", '<div class="a" id="x"><p>Hello <b>world</b></p></div>')
    same = html("same.html", '<div id="x" class="a"><p>Hello <b>world</b></p></div>')
    text = html("text.html", '<div class="a" id="x"><p>Hello <b>there</b></p></div>')
    attr = html("attr.html", '<div class="b" id="x"><p>Hello <b>world</b></p></div>')
    assert chrome_m.compare_htmls(same, gold) == 1.0
    assert chrome_m.compare_htmls(text, gold) == 0.0
    assert chrome_m.compare_htmls(attr, gold) == 0.0
    assert chrome_m.compare_htmls(None, gold) == 0.0


def test_registry() -> None:
    assert set(METRICS) >= {
        "compare_images", "check_structure_sim", "check_mp3_meta", "compare_audios", "compare_pdfs",
        "compare_archive", "compare_epub", "is_vlc_playing", "check_qt_bgcone", "check_play_and_exit",
    }
