"""chrome: Chromium answering as google-chrome, with CDP on 9222 for the evaluators."""
import json

from suitekit import DONE, chrome, cmdline, dl, execute, hotkey, poll, press, rule, type_text, wait_window_code

LOCAL = "0f5d2a10-0000-4000-8000-000000000401"
TABS = "0f5d2a10-0000-4000-8000-000000000402"
BOOKMARK = "0f5d2a10-0000-4000-8000-000000000403"
SAVE_PAGE = "0f5d2a10-0000-4000-8000-000000000404"
D = "/home/user/Desktop"


def page(title: str, body: str) -> str:
    return f"<!doctype html><html><head><title>{title}</title></head><body>{body}</body></html>\n"


def build(kit) -> None:
    kit.text(LOCAL, "welcome.html", "<!doctype html><html><head><title>Welcome to osfarm</title></head>"
             "<body><h1>Welcome</h1><p>An offline page.</p></body></html>\n")
    kit.task("chrome", LOCAL, "Open the local page ~/Desktop/welcome.html in the browser.",
             [dl(LOCAL, "welcome.html", "/home/user/Desktop/welcome.html")] + chrome("about:blank"),
             {"func": "is_expected_active_tab", "result": {"type": "active_tab_info"},
              "expected": rule(type="url", url="file:///home/user/Desktop/welcome.html")},
             [hotkey("ctrl", "l"), type_text("file:///home/user/Desktop/welcome.html\n"), DONE], ["chrome"])

    kit.text(TABS, "menu.html", page("Lunch menu", "<h1>Lunch</h1><p>Soup of the day: lentil.</p>"))
    kit.text(TABS, "hours.html", page("Opening hours", "<h1>Hours</h1><p>Mon-Fri 8-18.</p>"))
    kit.task("chrome", TABS, "Keep the lunch menu open in the browser and open ~/Desktop/hours.html in a second tab; "
             "no other tabs should be open.",
             [dl(TABS, n, f"{D}/{n}") for n in ("menu.html", "hours.html")] + chrome(f"file://{D}/menu.html"),
             {"func": "is_expected_tabs", "result": {"type": "open_tabs_info"},
              "expected": rule(type="url", urls=[f"file://{D}/menu.html", f"file://{D}/hours.html"])},
             # Alt+Enter in the address bar opens the typed URL in a new tab
             [hotkey("ctrl", "l"), type_text(f"file://{D}/hours.html"), hotkey("alt", "enter"), DONE], ["chrome"])

    kit.text(BOOKMARK, "recipes.html", page("Recipes", "<h1>Recipes</h1><p>Pancakes: flour, milk, eggs.</p>"))
    url = f"file://{D}/recipes.html"
    # A profile that already has a bookmark on the bar, as a used browser has: Chromium then files
    # new bookmarks there (its default is the most recently modified folder).
    existing = f"file://{D}/news.html"
    kit.text(BOOKMARK, "news.html", page("News", "<h1>News</h1>"))
    kit.text(BOOKMARK, "Bookmarks", json.dumps({"roots": {
        "bookmark_bar": {"children": [{"id": "4", "name": "News", "type": "url", "url": existing,
                                       "date_added": "13400000000000000"}],
                         "date_added": "13400000000000000", "date_modified": "13400000000000000",
                         "id": "1", "name": "Bookmarks bar", "type": "folder"},
        "other": {"children": [], "date_added": "13400000000000000", "date_modified": "0",
                  "id": "2", "name": "Other bookmarks", "type": "folder"},
        "synced": {"children": [], "date_added": "13400000000000000", "date_modified": "0",
                   "id": "3", "name": "Mobile bookmarks", "type": "folder"}}, "version": 1}, indent=1))
    kit.task("chrome", BOOKMARK, "Bookmark the page that is open in the browser on the bookmarks bar.",
             [dl(BOOKMARK, "recipes.html", f"{D}/recipes.html"), dl(BOOKMARK, "news.html", f"{D}/news.html"),
              dl(BOOKMARK, "Bookmarks", "/home/user/.config/google-chrome/Default/Bookmarks")] + chrome(url),
             # Chromium writes the Bookmarks file a few seconds after a change
             {"postconfig": [execute(poll("grep -qs recipes.html /home/user/.config/google-chrome/Default/Bookmarks",
                                          150) + "true")],
              "func": "is_expected_bookmarks", "result": {"type": "bookmarks"},
              "expected": rule(type="bookmark_bar_websites_urls", urls=[existing, url])},
             [hotkey("ctrl", "d"), press("enter"), DONE], ["chrome"])

    kit.text(SAVE_PAGE, "offer.html", page("Special offer", "<h1>Offer</h1><p id='code'>Voucher code OSF-2417-KX</p>"))
    target = "/home/user/Downloads/offer_saved.html"
    kit.task("chrome", SAVE_PAGE,
             "Save the web page open in the browser into the Downloads folder as offer_saved.html.",
             [dl(SAVE_PAGE, "offer.html", f"{D}/offer.html"), execute("mkdir -p /home/user/Downloads")]
             + chrome(f"file://{D}/offer.html"),
             {"func": "check_include_exclude",
              "result": cmdline(poll(f"grep -qs OSF-2417-KX {target}")
                                + f"grep -o 'Voucher code OSF-2417-KX' {target}"),
              "expected": rule(include=["Voucher code OSF-2417-KX"], exclude=[])},
             # GTK's file chooser takes a full path in its name field
             # the file chooser can take a few seconds to appear the first time: the agent waits
             [hotkey("ctrl", "s") + [wait_window_code("Save File")],
              hotkey("ctrl", "a") + type_text("offer_saved.html"),
              hotkey("alt", "s"), DONE], ["chrome"])  # Alt+S: the dialog has no default button for Enter
