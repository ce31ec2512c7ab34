"""thunderbird: tasks on a prepared offline profile (Local Folders only, no account to set up).

Like OSWorld, every task's setup unpacks a tar of ~/.thunderbird and then starts Thunderbird,
so the app opens straight on the mail view: no account wizard, start page, rights bar, default
client prompt, telemetry or update checks (the box has no network anyway).
"""
from __future__ import annotations

import gzip
import io
import json
import tarfile
from email.utils import parsedate_to_datetime

from suitekit import (
    DONE,
    activate,
    await_window,
    click_at,
    cmdline,
    dl,
    execute,
    gold,
    launch,
    poll,
    press,
    rule,
    type_text,
    vm_file,
    wait_window,
)

FOLDER = "0f5d2a10-0000-4000-8000-000000000701"
FILTER = "0f5d2a10-0000-4000-8000-000000000702"
PREF = "0f5d2a10-0000-4000-8000-000000000703"
MOVE = "0f5d2a10-0000-4000-8000-000000000704"
TAG = "0f5d2a10-0000-4000-8000-000000000705"
INFEASIBLE = "0f5d2a10-0000-4000-8000-000000000908"

PROFILE = "osfarm.default-release"
TB = f"/home/user/.thunderbird/{PROFILE}"
LOCAL = f"{TB}/Mail/Local Folders"
# Debian's /usr/lib/thunderbird hashes to this install id; a profile that the install section
# names is used as is, so Thunderbird never makes a profile of its own next to ours.
INSTALL_ID = "FDC34C9F024745EB"

PREFS = {
    # One Local Folders account: valid, so Thunderbird does not count the start as a first run.
    "mail.account.account1.server": "server1",
    "mail.accountmanager.accounts": "account1",
    "mail.accountmanager.localfoldersserver": "server1",
    "mail.server.server1.directory-rel": "[ProfD]Mail/Local Folders",
    "mail.server.server1.hostname": "Local Folders",
    "mail.server.server1.name": "Local Folders",
    "mail.server.server1.type": "none",
    "mail.server.server1.userName": "nobody",
    "mail.server.server1.storeContractID": "@mozilla.org/msgstore/berkeleystore;1",
    # Everything that would put a dialog, tab or bar over the mail view on a fresh start.
    "mail.provider.suppress_dialog_on_startup": True,
    "mail.rights.override": True,
    "mail.rights.version": 1,
    "mailnews.start_page.enabled": False,
    "mailnews.start_page_override.mstone": "ignore",
    "mail.shell.checkDefaultClient": False,
    "mail.inappnotifications.enabled": False,
    "datareporting.policy.dataSubmissionEnabled": False,
    "datareporting.healthreport.uploadEnabled": False,
    "toolkit.telemetry.enabled": False,
    "toolkit.telemetry.reportingpolicy.firstRun": False,
    "app.update.auto": False,
    "extensions.update.enabled": False,
    "network.captive-portal-service.enabled": False,
    "network.connectivity-service.enabled": False,
    # The global search indexer only burns CPU here; the quick filter works without it.
    "mailnews.database.global.indexer.enabled": False,
    "mail.biff.show_alert": False,
    "mail.biff.play_sound": False,
}

XULSTORE = {"chrome://messenger/content/messenger.xhtml": {"messengerWindow": {
    "screenX": "0", "screenY": "0", "width": "1920", "height": "1050", "sizemode": "maximized"}}}

# Thunderbird restores its last session: the Inbox selected, with Local Folders expanded.
SESSION = {"rev": 0, "windows": [{"type": "3pane", "tabs": {"rev": 0, "selectedIndex": 0, "tabs": [
    {"mode": "mail3PaneTab", "state": {"firstTab": True, "folderPaneVisible": True, "messagePaneVisible": True,
                                       "folderURI": "mailbox://nobody@Local%20Folders/Inbox"}, "ext": {}}]}}]}
FOLDER_TREE = {"open": {"all": ["mailbox://nobody@Local%20Folders"]}}

# (sender, subject, date, body) of the Inbox messages every task starts with.
INBOX = [
    ("Alice Martin <alice@example.org>", "Team lunch on Friday", "Mon, 04 Mar 2024 09:12:00 +0000",
     "Hi all,\nlunch is booked for Friday at noon.\nAlice\n"),
    ("Billing <billing@shop.example.com>", "Your invoice 2024-031", "Tue, 05 Mar 2024 14:03:00 +0000",
     "Please find the amount due below: 42.00 EUR.\n"),
    ("Bob Stone <bob@example.net>", "Quarterly report draft", "Wed, 06 Mar 2024 11:45:00 +0000",
     "Here is the draft of the quarterly report for review.\nBob\n"),
    ("Newsletter <news@updates.example.com>", "March product news", "Thu, 07 Mar 2024 08:00:00 +0000",
     "Our new features this month.\n"),
    ("Carol Diaz <carol@example.org>", "Invoice for the workshop", "Fri, 08 Mar 2024 16:30:00 +0000",
     "Attached is the invoice for last week's workshop.\nCarol\n"),
]


# Room Thunderbird rewrites tags into in place (as in the mbox files it writes itself).
KEYS_ROOM = " " * 80


def _mbox(messages) -> str:
    out = []
    for i, (sender, subject, date, body) in enumerate(messages, 1):
        envelope = parsedate_to_datetime(date).strftime("%a %b %d %H:%M:%S %Y")
        out.append(f"From - {envelope}\n"
                   "X-Mozilla-Status: 0000\nX-Mozilla-Status2: 00000000\n"
                   f"X-Mozilla-Keys: {KEYS_ROOM}\n"
                   f"Message-ID: <msg{i}@osfarm.invalid>\nDate: {date}\nFrom: {sender}\n"
                   f"To: user@osfarm.invalid\nSubject: {subject}\nMIME-Version: 1.0\n"
                   "Content-Type: text/plain; charset=UTF-8\nContent-Transfer-Encoding: 7bit\n\n"
                   f"{body}\n")
    return "".join(out)


def _prefs() -> str:
    lines = [f"user_pref({json.dumps(k)}, {json.dumps(v)});" for k, v in sorted(PREFS.items())]
    return "// Mozilla User Preferences\n\n" + "\n".join(lines) + "\n"


def profile_tar(folders: dict[str, str]) -> bytes:
    """A gzip tar of .thunderbird/ (same bytes on every build: fixed times, owners, order)."""
    files = {
        ".thunderbird/profiles.ini": (
            f"[Install{INSTALL_ID}]\nDefault={PROFILE}\nLocked=1\n\n"
            f"[Profile0]\nName=default-release\nIsRelative=1\nPath={PROFILE}\nDefault=1\n\n"
            "[General]\nStartWithLastProfile=1\nVersion=2\n"),
        ".thunderbird/installs.ini": f"[{INSTALL_ID}]\nDefault={PROFILE}\nLocked=1\n",
        f".thunderbird/{PROFILE}/prefs.js": _prefs(),
        f".thunderbird/{PROFILE}/xulstore.json": json.dumps(XULSTORE),
        f".thunderbird/{PROFILE}/session.json": json.dumps(SESSION),
        f".thunderbird/{PROFILE}/folderTree.json": json.dumps(FOLDER_TREE),
    }
    for name, body in folders.items():
        files[f".thunderbird/{PROFILE}/Mail/Local Folders/{name}"] = body
    buf = io.BytesIO()
    with gzip.GzipFile(fileobj=buf, mode="wb", mtime=0) as gz, tarfile.open(fileobj=gz, mode="w") as tar:
        dirs = sorted({p.rsplit("/", i)[0] for p in files for i in range(1, p.count("/") + 1)})
        for d in dirs:
            info = tarfile.TarInfo(d)
            info.type, info.mode, info.mtime = tarfile.DIRTYPE, 0o700, 1700000000
            tar.addfile(info)
        for name in sorted(files):
            data = files[name].encode()
            info = tarfile.TarInfo(name)
            info.size, info.mode, info.mtime = len(data), 0o600, 1700000000
            tar.addfile(info, io.BytesIO(data))
    return buf.getvalue()


def thunderbird(kit, tid: str, folders: dict[str, str] | None = None) -> list[dict]:
    """Setup steps: the profile tar downloaded and unpacked over ~ (as OSWorld does), then
    Thunderbird started and waited for until it shows the Inbox."""
    kit.path(tid, "thunderbird-profile.tar.gz").write_bytes(profile_tar(folders or {"Inbox": _mbox(INBOX)}))
    return [dl(tid, "thunderbird-profile.tar.gz", "/home/user/thunderbird-profile.tar.gz"),
            execute("tar -xz --recursive-unlink -f /home/user/thunderbird-profile.tar.gz -C /home/user/"),
            launch("/usr/bin/thunderbird"), wait_window("Inbox - Local Folders", 300),
            activate("Mozilla Thunderbird")]


def menu(*keys: str) -> list[str]:
    """One step: a key of an open menu, then a short pause so the next menu level is drawn."""
    return [f"pyautogui.hotkey({', '.join(repr(k) for k in keys)})", "time.sleep(0.4)"]


# Where things are on the 1920x1080 screen with this profile (maximized main window), on the light
# desktop and on GNOME.
LOCAL_ROW = click_at((142, 112), (194, 140))          # "Local Folders" in the folder pane
# the message cards, newest (top) first
CARD = [click_at((400, y), (400, y_gnome))
        for y, y_gnome in zip([124, 199, 273, 349, 423], [150, 234, 318, 402, 486], strict=True)]


def local(name: str) -> str:
    return f"'{LOCAL}/{name}'"


def build(kit) -> None:
    kit.task("thunderbird", FOLDER,
             "In Thunderbird, create a new mail folder named \"Receipts\" directly under Local Folders.",
             thunderbird(kit, FOLDER),
             {"postconfig": [execute(poll(f"[ -e {local('Receipts')} ]") + "true")],
              "func": "check_include_exclude", "result": cmdline(f"ls {local('')}"),
              "expected": rule(include=["Receipts\n"], exclude=[])},
             [LOCAL_ROW, menu("alt", "f"), menu("right"), menu("f") + await_window("New Folder"),
              type_text("Receipts\n"), DONE], ["thunderbird"])

    kit.task("thunderbird", FILTER,
             "In Thunderbird, create a message filter for Local Folders named \"Invoices\" that adds a star "
             "to every message whose subject contains \"invoice\".",
             thunderbird(kit, FILTER),
             {"postconfig": [execute(poll(f"grep -q '^name=' {local('msgFilterRules.dat')}") + "true")],
              "func": "check_thunderbird_filter", "result": vm_file(f"{LOCAL}/msgFilterRules.dat"),
              "expected": rule(expect=[{"name": "Invoices", "enabled": "yes", "action": "Mark flagged",
                                        "condition": ["AND (subject,contains,invoice)"]}], unexpect=[])},
             [menu("alt", "t"), menu("f") + await_window("Message Filters"),
              menu("alt", "n") + await_window("Filter Rules"), type_text("Invoices"),
              click_at((1170, 501), (1206, 530)), type_text("invoice"),  # the value box of Subject/contains
              click_at((614, 655), (646, 686)) + ["time.sleep(0.4)"],    # the action list: Move Message to ...
              press("a") + press("enter"),                                # ... Add Star
              click_at((1358, 832), (1388, 862)) + await_window("Filter Rules", present=False),  # OK
              press("escape"), DONE], ["thunderbird"])          # closing the list saves the filters

    kit.task("thunderbird", PREF,
             "Set Thunderbird to display the body of messages as plain text instead of HTML.",
             thunderbird(kit, PREF),
             {"postconfig": [execute(poll(f"grep -q 'prefer_plaintext' {TB}/prefs.js") + "true")],
              "func": "check_thunderbird_prefs", "result": vm_file(f"{TB}/prefs.js"),
              "expected": rule(expect={"mailnews.display.prefer_plaintext": {"method": "eq", "ref": True},
                                       "mailnews.display.html_as": {"method": "eq", "ref": 1}},
                               unexpect={})},
             [menu("alt", "v"), menu("b"), menu("p"), DONE], ["thunderbird"])  # View > Message Body As > Plain Text

    kit.task("thunderbird", MOVE,
             "Move the email \"Quarterly report draft\" from the Inbox to the Projects folder in Thunderbird.",
             thunderbird(kit, MOVE, {"Inbox": _mbox(INBOX), "Projects": ""}),
             {"postconfig": [execute(poll(f"[ -s {local('Projects')} ]") + "true")],
              "func": "check_include_exclude",
              # The subjects of the messages each folder holds; a moved message stays in the
              # Inbox's mbox, flagged expunged (X-Mozilla-Status 0008/0009), until compaction.
              "result": cmdline(f"cd {local('')} && awk '/^X-Mozilla-Status: /{{s=$2}} "
                                "/^Subject: /{if (s !~ /^000[89]$/) print FILENAME \": \" $0}' Inbox Projects"),
              "expected": rule(include=["Projects: Subject: Quarterly report draft"],
                               exclude=["Inbox: Subject: Quarterly report draft"])},
             [CARD[2], menu("alt", "m"), menu("m"), menu("l"), menu("p"), DONE], ["thunderbird"])

    tagged = _mbox(INBOX).replace(f"X-Mozilla-Keys: {KEYS_ROOM}", "X-Mozilla-Keys: $label1" + " " * 73, 1)
    kit.text(TAG, "Inbox_gold", tagged)
    kit.task("thunderbird", TAG,
             "In Thunderbird, tag the email \"Team lunch on Friday\" in the Inbox as Important.",
             thunderbird(kit, TAG),
             {"postconfig": [execute(poll(f"grep -q 'label1' {local('Inbox')}") + "true")],
              "func": "check_thunderbird_folder", "result": vm_file(f"{LOCAL}/Inbox"),
              "expected": gold(TAG, "Inbox_gold"), "options": {"ignore_status": True}},
             [CARD[4], press("1"), DONE], ["thunderbird"])  # key 1 = the Important tag

    kit.infeasible("thunderbird", INFEASIBLE,
                   "In Thunderbird, recall the last email I sent to Bob so that it disappears from his mailbox.")
