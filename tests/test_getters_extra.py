"""OSWorld getters added to close the coverage of test_all: the active tab's URL from the
accessibility tree and what is parsed out of it or out of its page, pages and settings opened for
the evaluation, Chrome's delete-on-exit setting, the default video player, VS Code's probe, and
the media of an Impress slide.

The parsing is tested against a fake controller; the slow tests run a real desktop where
Chromium serves pages from a local HTTP server and answers DevTools on port 9222.
"""

from __future__ import annotations

import json
import zipfile
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any
from xml.sax.saxutils import escape

import pptx
import pytest
from PIL import Image
from pptx.util import Inches

from osfarm.evaluators.errors import RuleError, UnsupportedOption
from osfarm.evaluators.getters import GETTERS, EvalEnv, vlc
from osfarm.tasks.controller import GuestController
from osfarm.testing.boxes import sandbox_guest
from osfarm.testing.waiting import wait_until

PREFS = "/home/user/.config/google-chrome/Default/Preferences"
ST = "https://accessibility.ubuntu.example.org/ns/state"


class FakeController:
    """The few controller calls these getters make, answered from memory."""

    def __init__(self, files: dict[str, bytes] | None = None, tree: str | None = None,
                 output: str = "", raises: bool = False) -> None:
        self.files = dict(files or {})
        self.tree, self.output, self.raises = tree, output, raises
        self.commands: list[Any] = []

    def get_file(self, path: str) -> bytes | None:
        return self.files.get(path)

    def download_file(self, path: str, dest: str | Path, max_bytes: int | None = None) -> bool:
        data = self.files.get(path)
        if data is not None:
            Path(dest).write_bytes(data)
        return data is not None

    def get_accessibility_tree(self) -> str | None:
        if self.raises:
            raise RuntimeError("guest gone")
        return self.tree

    def execute(self, command: Any, shell: bool = False, timeout: float = 120) -> dict:
        self.commands.append(command)
        return {"status": "success", "output": self.output, "error": "", "returncode": 0}

    def wait_for_file(self, path: str, timeout: float = 30.0, min_size: int = 0) -> bool:
        return path in self.files


def fake_env(tmp_path: Path, **kw: Any) -> EvalEnv:
    return EvalEnv(controller=FakeController(**kw), cache_dir=tmp_path / "cache")


def get(name: str, env: EvalEnv, config: dict) -> Any:
    return GETTERS[name](env, config)


def browser_tree(*bars: tuple[str, bool], app: str = "Chromium") -> str:
    focus = ' st:focused="true"'
    entries = "".join(
        f'<entry name="Address and search bar" st:editable="true"{focus if focused else ""}>{escape(text)}</entry>'
        for text, focused in bars
    )
    return (f'<desktop-frame xmlns:st="{ST}"><application name="xfce4-terminal"><entry name="Address and search bar">'
            f"not-a-browser.org</entry></application><application name=\"{app}\"><frame name=\"w\">{entries}"
            "</frame></application></desktop-frame>")


# ------------------------------------------------------------------ the address bar (a11y tree)


def test_active_url_from_access_tree(tmp_path: Path) -> None:
    env = fake_env(tmp_path, tree=browser_tree(("127.0.0.1:8000/a.html?q=1", False)))
    assert get("active_url_from_accessTree", env, {"goto_prefix": "http://"}) == "http://127.0.0.1:8000/a.html?q=1"
    assert get("active_url_from_accessTree", env, {}) == "https://127.0.0.1:8000/a.html?q=1"  # OSWorld's default
    env = fake_env(tmp_path, tree=browser_tree(("www.kohls.com/search?x=1", False), app="Google Chrome"))
    assert get("active_url_from_accessTree", env, {"goto_prefix": "https://www."}) == "https://www.kohls.com/search?x=1"
    for text in ("chrome://settings/appearance", "file:///home/user/a.html", "http://localhost:8000/x"):
        env = fake_env(tmp_path, tree=browser_tree((text, False)))
        assert get("active_url_from_accessTree", env, {"goto_prefix": "https://www."}) == text
    env = fake_env(tmp_path, tree=browser_tree(("localhost:8000/x", False)))
    assert get("active_url_from_accessTree", env, {"goto_prefix": "http://"}) == "http://localhost:8000/x"
    # two windows: the focused bar wins, else the last one with text
    two = browser_tree(("a.org/1", True), ("b.org/2", False))
    assert get("active_url_from_accessTree", fake_env(tmp_path, tree=two), {"goto_prefix": ""}) == "a.org/1"
    two = browser_tree(("a.org/1", False), ("b.org/2", False), ("", False))
    assert get("active_url_from_accessTree", fake_env(tmp_path, tree=two), {"goto_prefix": ""}) == "b.org/2"
    # no browser, no tree, a broken guest: None
    assert get("active_url_from_accessTree", fake_env(tmp_path, tree=browser_tree()), {}) is None
    assert get("active_url_from_accessTree", fake_env(tmp_path, tree=None), {}) is None
    assert get("active_url_from_accessTree", fake_env(tmp_path, tree="<oops"), {}) is None
    assert get("active_url_from_accessTree", fake_env(tmp_path, raises=True), {}) is None


def test_active_tab_url_parse(tmp_path: Path) -> None:
    url = "shopping.google.com/search?q=drip+coffee+maker&tbs=mr:1,price:1,ppr_min:25&hl=en"
    env = fake_env(tmp_path, tree=browser_tree((url, False)))
    cfg = {"goto_prefix": "https://www.", "parse_keys": ["q", "tbs", "gl"]}
    tbs = "mr:1,price:1,ppr_min:25"
    assert get("active_tab_url_parse", env, cfg) == {"q": "drip coffee maker", "tbs": tbs, "gl": ""}
    cfg = {"parse_keys": ["q", "tbs"], "replace": {"tbs": "filters"}, "split_list": True}
    assert get("active_tab_url_parse", env, cfg) == {"q": ["drip coffee maker"], "filters": tbs.split(",")}
    assert get("active_tab_url_parse", fake_env(tmp_path, tree=None), cfg) is None


def test_url_dash_part(tmp_path: Path) -> None:
    env = fake_env(tmp_path, tree=browser_tree(("accuweather.com/en/gb/manchester/m15-6/may-weather/329260", False)))
    cfg = {"goto_prefix": "https://www.", "partIndex": -2, "needDeleteId": False, "returnType": "json", "key": "time"}
    assert get("url_dashPart", env, cfg) == {"time": "may-weather"}
    env = fake_env(tmp_path, tree=browser_tree(("macys.com/shop/mens/Stripe,Men,L?id=30423", False)))
    cfg = {"goto_prefix": "https://www.", "partIndex": -1, "needDeleteId": True, "returnType": "string"}
    assert get("url_dashPart", env, cfg) == "Stripe,Men,L"
    assert get("url_dashPart", env, {**cfg, "partIndex": 40}) is None
    with pytest.raises(UnsupportedOption):
        get("url_dashPart", env, {**cfg, "returnType": "xml"})


def test_url_path_parse(tmp_path: Path) -> None:
    keys = ["mens_clothing", "shirts", "Men_regular_size_t", "Price_discount_range", "short_sleeve"]
    url = ("macys.com/shop/mens-clothing/mens-t-shirts/Men_regular_size_t,Price_discount_range,Sleeve_length/"
           "L,50_PERCENT_%20off%20%26%20more,Short%20Sleeve?id=30423")
    env = fake_env(tmp_path, tree=browser_tree((url, False)))
    assert get("url_path_parse", env, {"goto_prefix": "https://www.", "parse_keys": keys}) == {
        "mens_clothing": True, "shirts": True, "short_sleeve": True, "Men_regular_size_t": "L",
        "Price_discount_range": "50_PERCENT_ off & more"}
    url = ("macys.com/shop/womens/Product_department,Price_discount_range/"
           "Shirts,30_PERCENT_%20off%20%26%20more%7C50_PERCENT_%20off%20%26%20more")
    env = fake_env(tmp_path, tree=browser_tree((url, False)))
    assert get("url_path_parse", env, {"parse_keys": keys}) == {
        "mens_clothing": None, "shirts": True, "short_sleeve": None, "Men_regular_size_t": None,
        "Price_discount_range": "not_50_PERCENT_ off & more"}
    assert get("url_path_parse", fake_env(tmp_path, tree=None), {"parse_keys": keys}) is None


def test_active_tab_html_parse_config_errors(tmp_path: Path) -> None:
    env = fake_env(tmp_path, tree=None)
    with pytest.raises(UnsupportedOption, match="category"):
        get("active_tab_html_parse", env, {"category": "css"})
    assert get("active_tab_html_parse", env, {"category": "xpath", "xpathObject": {}}) is None


# ------------------------------------------------------------------ Chrome's profile, a desktop's defaults


def test_data_delete_automacally(tmp_path: Path) -> None:
    on = {"profile": {"default_content_setting_values": {"cookies": 4, "has_migrated_local_network_access": True}}}
    fresh = {"profile": {"default_content_setting_values": {"has_migrated_local_network_access": True}}}
    assert get("data_delete_automacally", fake_env(tmp_path, files={PREFS: json.dumps(on).encode()}), {}) == "true"
    assert get("data_delete_automacally", fake_env(tmp_path, files={PREFS: json.dumps(fresh).encode()}), {}) == "false"
    assert get("data_delete_automacally", fake_env(tmp_path), {}) == "false"


def test_chrome_appearance_mode_falls_back_to_preferences(tmp_path: Path) -> None:
    # The fake controller's DevTools script prints nothing: the settings page never answers.
    def mode(prefs: dict | None) -> str:
        files = {PREFS: json.dumps(prefs).encode()} if prefs is not None else {}
        return get("chrome_appearance_mode_ui", fake_env(tmp_path, files=files), {})

    assert mode({"browser": {"theme": {"color_scheme2": 2}}}) == "dark"
    assert mode({"browser": {"theme": {"color_scheme": 1}}}) == "light"
    assert mode({"browser": {"theme": {"color_scheme2": 2}}, "extensions": {"theme": {"system_theme": 0}}}) == "light"
    assert mode({"extensions": {"theme": {"system_theme": 1}}}) == "system"
    assert mode(None) == "system"


def test_default_video_player(tmp_path: Path) -> None:
    answers = {"mp4": "vlc.desktop", "webm": "vlc.desktop", "x-matroska": "mpv.desktop", "ogg": ""}
    env = fake_env(tmp_path, output=json.dumps(answers) + "\n")
    assert get("default_video_player", env, {}) == "vlc.desktop"
    assert env.controller.commands[0][:2] == ["python3", "-c"] and "x-theora+ogg" in env.controller.commands[0]
    assert get("default_video_player", fake_env(tmp_path, output=json.dumps({"mp4": ""})), {}) == "unknown"
    assert get("default_video_player", fake_env(tmp_path, output="garbage"), {}) == "unknown"


def test_vscode_config(tmp_path: Path) -> None:
    env = fake_env(tmp_path, files={"/home/user/OpenProject.txt": b"project"})
    cfg = {"vscode_extension_command": "OpenProject", "path": "/home/user/OpenProject.txt", "dest": "OpenProject.txt"}
    p = get("vscode_config", env, cfg)
    assert Path(p).read_bytes() == b"project" and Path(p).name == "OpenProject.txt"
    (cmd,) = env.controller.commands
    assert cmd[:2] == ["python3", "-c"] and "pyautogui" in cmd[2] and cmd[3] == "OpenProject"
    assert get("vscode_config", fake_env(tmp_path), cfg) is None


# ------------------------------------------------------------------ Impress: media of a slide

REL_AUDIO = "http://schemas.openxmlformats.org/officeDocument/2006/relationships/audio"
REL_MEDIA = "http://schemas.microsoft.com/office/2007/relationships/media"
BG = (b'<p:bg><p:bgPr><a:blipFill rotWithShape="0"><a:blip r:embed="{rid}"/><a:stretch><a:fillRect/></a:stretch>'
      b"</a:blipFill><a:effectLst/></p:bgPr></p:bg>")


def rewrite(src: Path, dst: Path, edit: dict[str, Any], extra: dict[str, bytes] | None = None) -> bytes:
    with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dst, "w", zipfile.ZIP_DEFLATED) as zout:
        for item in zin.infolist():
            data = zin.read(item.filename)
            if item.filename in edit:
                data = edit[item.filename](data)
            zout.writestr(item, data)
        for name, data in (extra or {}).items():
            zout.writestr(name, data)
    return dst.read_bytes()


def two_slides(tmp_path: Path, picture: bool = False) -> Path:
    prs = pptx.Presentation()
    for _ in range(2):
        slide = prs.slides.add_slide(prs.slide_layouts[6])
    if picture:
        img = tmp_path / "landscape.png"
        Image.new("RGB", (64, 48), (30, 120, 200)).save(img)
        slide.shapes.add_picture(str(img), Inches(1), Inches(1))  # slide 2 gets an image relation
    path = tmp_path / ("pic.pptx" if picture else "plain.pptx")
    prs.save(path)
    return path


def add_rel(xml: bytes, rid: str, kind: str, target: str, external: bool = False) -> bytes:
    mode = b' TargetMode="External"' if external else b""
    rel = f'<Relationship Id="{rid}" Type="{kind}" Target="{target}"'.encode() + mode + b"/>"
    return xml.replace(b"</Relationships>", rel + b"</Relationships>")


def test_audio_in_slide(tmp_path: Path) -> None:
    plain = two_slides(tmp_path)
    embedded = rewrite(plain, tmp_path / "emb.pptx", {
        "ppt/slides/_rels/slide1.xml.rels": lambda x: add_rel(add_rel(x, "rId8", REL_MEDIA, "../media/media1.mp3"),
                                                               "rId9", REL_AUDIO, "../media/media1.mp3")},
        extra={"ppt/media/media1.mp3": b"ID3-fake-mp3"})
    linked = rewrite(plain, tmp_path / "link.pptx", {
        "ppt/slides/_rels/slide1.xml.rels": lambda x: add_rel(x, "rId9", REL_AUDIO,
                                                               "file:///home/user/Desktop/Base%20ball.mp3", True)})
    files = {"/home/user/Desktop/emb.pptx": embedded, "/home/user/Desktop/link.pptx": linked,
             "/home/user/Desktop/plain.pptx": plain.read_bytes(), "/home/user/Desktop/Base ball.mp3": b"linked-mp3"}
    env = fake_env(tmp_path, files=files)
    cfg = {"ppt_file_path": "/home/user/Desktop/emb.pptx", "slide_index": 0, "dest": "Baseball.mp3"}
    assert Path(get("audio_in_slide", env, cfg)).read_bytes() == b"ID3-fake-mp3"
    cfg["ppt_file_path"] = "/home/user/Desktop/link.pptx"
    assert Path(get("audio_in_slide", env, cfg)).read_bytes() == b"linked-mp3"
    assert get("audio_in_slide", env, {**cfg, "slide_index": 1}) is None
    assert get("audio_in_slide", env, {**cfg, "ppt_file_path": "/home/user/Desktop/plain.pptx"}) is None
    assert get("audio_in_slide", env, {**cfg, "ppt_file_path": "/home/user/Desktop/none.pptx"}) is None


def test_background_image_in_slide(tmp_path: Path) -> None:
    pic = two_slides(tmp_path, picture=True)
    with zipfile.ZipFile(pic) as z:
        rels = z.read("ppt/slides/_rels/slide2.xml.rels").decode()
        rid = rels.split('Type="http://schemas.openxmlformats.org/officeDocument/2006/relationships/image"')[0]
        rid = rid.rsplit('Id="', 1)[1].split('"', 1)[0]
        image = z.read("ppt/media/image1.png")
    with_bg = rewrite(pic, tmp_path / "bg.pptx", {
        "ppt/slides/slide2.xml": lambda x: x.replace(b"<p:cSld>", b"<p:cSld>" + BG.replace(b"{rid}", rid.encode()), 1)})
    env = fake_env(tmp_path, files={"/home/user/bg.pptx": with_bg, "/home/user/pic.pptx": pic.read_bytes()})
    cfg = {"ppt_file_path": "/home/user/bg.pptx", "slide_index": 1, "dest": "landscape.png"}
    got = get("background_image_in_slide", env, cfg)
    assert Path(got).name == "landscape.png" and Path(got).read_bytes() == image
    assert get("background_image_in_slide", env, {**cfg, "slide_index": 0}) is None  # plain background
    assert get("background_image_in_slide", env, {**cfg, "ppt_file_path": "/home/user/pic.pptx"}) is None
    assert get("background_image_in_slide", env, {**cfg, "slide_index": 7}) is None


@pytest.mark.parametrize("dest", ["../escaped.txt", "sub/../../escaped.txt", "/tmp/escaped.txt", "", "."])
def test_a_task_cannot_make_getters_write_or_read_outside_the_cache_dir(tmp_path: Path, dest: str) -> None:
    """dest/path come from task files (hostile); the evaluator runs on the host, not in the box."""
    env = fake_env(tmp_path, files={"/home/user/a.txt": b"agent's bytes"},
                   output="<root><state>playing</state></root>")
    (tmp_path / "host-secret").write_text("secret")
    for name, cfg in [
        ("vm_file", {"path": "/home/user/a.txt", "dest": dest}),
        ("vm_file", {"path": ["/home/user/a.txt", "/home/user/a.txt"], "dest": ["ok.txt", dest], "multi": True}),
        ("vlc_playing_info", {"dest": dest}),
        ("cache_file", {"path": dest or "../host-secret"}),
    ]:
        with pytest.raises(RuleError, match="inside the episode's cache dir"):
            get(name, env, cfg)
    assert sorted(p.name for p in tmp_path.rglob("*")) == ["cache", "host-secret", "ok.txt"]
    # a sub-folder inside the cache dir is fine
    assert Path(get("vm_file", env, {"path": "/home/user/a.txt", "dest": "sub/a.txt"})).read_bytes() == b"agent's bytes"


# ------------------------------------------------------------------ a real desktop with Chromium

PAGE_A = b"""<!doctype html><html><head><title>Flights</title></head><body>
<script>document.cookie = "cart=The Dota 2 Official Soundtrack; path=/";</script>
<div class="search-segment-cities__city">NYC</div><div class="search-segment-cities__city">CMH</div>
<span class="search-date">Tue, May 7, 2024</span>
<main><div><p>from</p><p>Mon, 6 May 2024, 10:00</p></div></main>
<section><label>Pick-up date</label><span>Fri, 10 May</span></section>
<form><input id="where" value="  Zurich "></form>
<ul><li class="filter">Kids</li><li class="filter">Toys</li></ul>
</body></html>"""
CART = b"""<!doctype html><html><head><title>Cart</title></head><body><div id="items"></div>
<script>document.getElementById("items").textContent = decodeURIComponent(document.cookie);</script></body></html>"""


@pytest.fixture(scope="module")
async def desktop() -> AsyncIterator[GuestController]:
    async with sandbox_guest("gx", 1280, 800) as ctl:
        ctl.upload_file("/home/user/site/flights.html", PAGE_A)
        ctl.upload_file("/home/user/site/cart.html", CART)
        ctl.launch("cd /home/user/site && exec python3 -m http.server 8000 --bind 127.0.0.1", shell=True)
        # OSWorld's setup: Chrome on 1337, socat forwarding 9222 to it.
        ctl.launch(["google-chrome", "--remote-debugging-port=1337", "http://127.0.0.1:8000/flights.html?from=NYC&to=CMH"])
        ctl.launch(["socat", "tcp-listen:9222,fork", "tcp:localhost:1337"])
        yield ctl


@pytest.fixture
def denv(desktop: GuestController, tmp_path: Path) -> EvalEnv:
    return EvalEnv(controller=desktop, cache_dir=tmp_path / "cache", task_id="gx")


@pytest.mark.slow
def test_chromium_active_tab_from_the_address_bar(denv: EvalEnv) -> None:
    url = wait_until(lambda: get("active_url_from_accessTree", denv, {"goto_prefix": "http://"}), 90,
                     "Chromium's address bar in the accessibility tree", interval=1)
    assert url == "http://127.0.0.1:8000/flights.html?from=NYC&to=CMH"
    assert get("active_tab_url_parse", denv, {"goto_prefix": "http://", "parse_keys": ["from", "to"]}) == {
        "from": "NYC", "to": "CMH"}
    def parse(category: str, **cfg: Any) -> Any:
        return get("active_tab_html_parse", denv, {"goto_prefix": "http://", "category": category, **cfg})

    cities = {"search-segment-cities__city": {"0": "start", "1": "end"}}
    got = parse("class", class_singleObject={"search-date": "time"}, class_multiObject=cities)
    assert got == {"start": "NYC", "end": "CMH", "time": "Tue, May 7, 2024"}
    got = parse("xpath", xpathObject={"/html/body/main/div/p[2]": "from", "/html/body/nav": "none"})
    assert got == {"from": "Mon, 6 May 2024, 10:00", "none": ""}
    assert parse("input", inputObject={"//input[@id='where']": "where"}) == {"where": "Zurich"}
    assert parse("label", labelObject={"pick-up DATE": "label"}) == {"label": "Pick-up date"}
    got = parse("class&url", class_multiObject={"filter": ["Kids"]}, url_include_expected=["from=NYC", "sort=price"])
    assert got == {"kids": True, "is_other_exist": True, "from=nyc": True, "sort=price": False}
    # a prefix that names another URL finds no tab: {} (scores 0)
    assert get("active_tab_html_parse", denv, {"goto_prefix": "https://", "category": "class"}) == {}


@pytest.mark.slow
def test_chromium_pages_opened_for_the_evaluation(denv: EvalEnv) -> None:
    wait_until(lambda: get("active_url_from_accessTree", denv, {}), 90, "Chromium's first page", interval=1)
    tabs_before = get("open_tabs_info", denv, {})
    # page_info opens the cart in the running browser: the cookie the first page set is there,
    # and the DOM is read after the page's scripts ran.
    info = get("page_info", denv, {"url": "http://127.0.0.1:8000/cart.html"})
    assert info["title"] == "Cart" and info["url"] == "http://127.0.0.1:8000/cart.html"
    assert "The Dota 2 Official Soundtrack" in info["content"]
    assert get("page_info", denv, {"url": "http://127.0.0.1:9/nothing"}) == {
        "title": "Connection failed", "url": "http://127.0.0.1:9/nothing", "content": ""}
    assert get("chrome_appearance_mode_ui", denv, {}) == "system"  # Chromium's default: follow the device
    assert get("data_delete_automacally", denv, {}) == "false"
    assert get("open_tabs_info", denv, {}) == tabs_before  # the evaluation's tabs are closed again


@pytest.mark.slow
def test_default_video_player_in_a_desktop(denv: EvalEnv) -> None:
    ctl = denv.controller
    ctl.upload_file("/home/user/.local/share/applications/osfarm-player.desktop",
                    b"[Desktop Entry]\nType=Application\nName=Player\nExec=true %f\nMimeType=video/mp4;\n")
    # the desktop's own default, as on OSWorld's Ubuntu: Videos (Totem); VLC only for .mp4
    assert get("default_video_player", denv, {}) == "org.gnome.Totem.desktop"
    types = " ".join(f"video/{t}" for t in vlc._VIDEO_SUBTYPES)
    ctl.execute(f"xdg-mime default osfarm-player.desktop {types}", shell=True)
    assert get("default_video_player", denv, {}) == "osfarm-player.desktop"
