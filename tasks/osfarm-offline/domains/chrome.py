"""chrome: Chromium answering as google-chrome, with CDP on 9222 for the evaluators."""
from suitekit import DONE, chrome, dl, hotkey, rule, type_text

LOCAL = "0f5d2a10-0000-4000-8000-000000000401"


def build(kit) -> None:
    kit.text(LOCAL, "welcome.html", "<!doctype html><html><head><title>Welcome to osfarm</title></head>"
             "<body><h1>Welcome</h1><p>An offline page.</p></body></html>\n")
    kit.task("chrome", LOCAL, "Open the local page ~/Desktop/welcome.html in the browser.",
             [dl(LOCAL, "welcome.html", "/home/user/Desktop/welcome.html")] + chrome(),
             {"func": "is_expected_active_tab", "result": {"type": "active_tab_info"},
              "expected": rule(type="url", url="file:///home/user/Desktop/welcome.html")},
             [hotkey("ctrl", "l"), type_text("file:///home/user/Desktop/welcome.html\n"), DONE], ["chrome"])
