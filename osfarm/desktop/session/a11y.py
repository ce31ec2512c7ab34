"""The accessibility (AT-SPI) tree of the desktop, in OSWorld's XML form.

Runs INSIDE a desktop session. ``accessibility_tree()`` walks every application registered on
the AT-SPI bus and returns XML shaped like OSWorld's ``/accessibility`` reply: a root
``<desktop-frame>`` with one child per application; each element is named by its role with
spaces turned into dashes (``push-button``, ``table-cell``), carries ``name`` and namespaced
attributes (``st:*`` states, ``attr:*`` object attributes, ``cp:screencoord``/``cp:size``,
``doc:*``/``docattr:*``, ``val:*``, ``act:*``) and holds the node's text as element text. The
namespace URIs are OSWorld's (``https://accessibility.ubuntu.example.org/ns/...``), so OSWorld's
own XPath-based getters and tree linearisers work on our output unchanged.

Differences from OSWorld's walker, all deliberate:

* Bounded: depth, width, node count and wall time are capped, and every D-Bus call has a short
  timeout; an application that stops answering is cut off (its subtree ends where it stopped)
  instead of stalling the whole reply. The result is always well-formed XML.
* Spreadsheet tables (LibreOffice Calc exposes ~1.7e10 cells) are read only over their visible
  window: the cells under the table's top-left and bottom-right visible corners give the
  row/column range, and only those cells are fetched.
* Characters that XML 1.0 cannot carry, and U+FFFC/U+FFFD placeholders, are removed; attribute
  names that are not XML names are made into ones.

Environment the session launcher must provide, found by experiment on Debian 12 (at-spi2-core
2.46, GTK 3, LibreOffice 7.4, Chromium 156, xfce4-terminal 1.0):

* ``DISPLAY`` and ``DBUS_SESSION_BUS_ADDRESS`` set (same values for apps and for the process
  that imports this module), an ``at-spi-bus-launcher --launch-immediately`` running on that
  session bus (it starts the a11y bus and ``at-spi2-registryd``).
* ``org.a11y.Status.IsEnabled = true`` on the session bus object ``org.a11y.Bus`` at
  ``/org/a11y/bus`` -- call :func:`osfarm.desktop.session.a11y_bus.set_a11y_enabled` (or ``dbus-send --session
  --dest=org.a11y.Bus /org/a11y/bus org.freedesktop.DBus.Properties.Set string:org.a11y.Status
  string:IsEnabled variant:boolean:true``) BEFORE starting apps. Chromium exposes nothing
  without it, even with ``--force-renderer-accessibility``. (The launcher mirrors it into the
  GSettings key ``org.gnome.desktop.interface toolkit-accessibility``, which Chromium reads too;
  that goes through dconf, so ``$HOME`` must be writable; Qt apps also read IsEnabled.)
* ``AT_SPI_BUS_ADDRESS`` = :func:`osfarm.desktop.session.a11y_bus.a11y_bus_address` exported to every
  app. Without it libatspi/the ATK bridge read the ``AT_SPI_BUS`` property of the X root window
  first; seen here: another session's launcher wrote its own bus address onto our display, and
  Chromium silently registered nowhere.
* ``NO_AT_BRIDGE`` unset (GTK 3 apps, e.g. xfce4-terminal, load the ATK bridge by themselves;
  ``GTK_MODULES=gail:atk-bridge`` is only needed for GTK 2 apps and harmless otherwise).
* LibreOffice: ``SAL_USE_VCLPLUGIN=gtk3`` (the default ``x11``/``gen`` plugin picked under a
  bare window manager exposes no accessibility on Linux).
* Chromium: ``--force-renderer-accessibility`` so web content is exposed without waiting for an
  assistive technology to ask for it.
* Qt apps: ``QT_ACCESSIBILITY=1`` and ``QT_LINUX_ACCESSIBILITY_ALWAYS_ON=1``.
* Java apps (not needed by OSWorld tasks): ``libatk-wrapper-java`` plus
  ``JAVA_TOOL_OPTIONS=-Djavax.accessibility.assistive_technologies=org.GNOME.Accessibility.AtkWrapper``.

How it reads: plain D-Bus calls with hard timeouts (:mod:`osfarm.desktop.session.a11y_bus`, which says
why not libatspi/pyatspi), pipelined level by level. Role and state names still come from
libatspi's tables, so tags and ``st:`` names are exactly pyatspi's (hence OSWorld's).

Thread-safety: every public function takes the module lock ``_LOCK`` (one walk at a time; the
shared connection and budgets are not meant for concurrent walks). They are blocking calls
meant for worker threads.
"""

from __future__ import annotations

import re
import threading
import time
from typing import Any

from osfarm.desktop.session.a11y_bus import (
    ACCESSIBLE,
    CALL_TIMEOUT_MS,
    NULL_PATH,
    PROPERTIES,
    REGISTRY,
    ROOT_PATH,
    AppGone,
    Bus,
    Ref,
    get_bus,
    is_gone,
    variant,
)

__all__ = ["accessibility_tree", "terminal_text", "NS"]

NS: dict[str, str] = {
    "st": "https://accessibility.ubuntu.example.org/ns/state",
    "attr": "https://accessibility.ubuntu.example.org/ns/attributes",
    "cp": "https://accessibility.ubuntu.example.org/ns/component",
    "doc": "https://accessibility.ubuntu.example.org/ns/document",
    "docattr": "https://accessibility.ubuntu.example.org/ns/document/attributes",
    "txt": "https://accessibility.ubuntu.example.org/ns/text",
    "val": "https://accessibility.ubuntu.example.org/ns/value",
    "act": "https://accessibility.ubuntu.example.org/ns/action",
}

_LOCK = threading.Lock()

# A runaway text node (a terminal's scrollback, a long document) is clipped in the tree.
_MAX_TEXT_CHARS = 100_000
# Outstanding pipelined calls; well under dbus-daemon's per-connection pending-reply limit.
_IN_FLIGHT = 96

_BAD_XML_CHARS = re.compile("[\x00-\x08\x0b\x0c\x0e-\x1f\ufffc\ufffd\ufffe\uffff\ud800-\udfff]")
_BAD_NAME_CHARS = re.compile(r"[^A-Za-z0-9_.\-]")
_CELL_NAME = re.compile(r"^\$?([A-Z]{1,3})\$?([0-9]{1,7})$")

_COORD_SCREEN = 0
# AtspiStateType values (a stable D-Bus ABI: bit numbers in GetState's reply).
_STATE_ACTIVE, _STATE_DEFUNCT, _STATE_FOCUSED, _STATE_SHOWING, _STATE_VISIBLE = 1, 6, 12, 25, 30

_VALUE_PROPS = (("value", "CurrentValue"), ("min", "MinimumValue"), ("max", "MaximumValue"),
                ("step", "MinimumIncrement"))

_role_names: dict[int, str] = {}
_role_ids: dict[str, int] = {}
_state_names: dict[int, str] = {}


def _tables() -> None:
    """Role and state names exactly as pyatspi (hence OSWorld) spells them; no D-Bus involved."""
    if _role_names:
        return
    import gi

    gi.require_version("Atspi", "2.0")
    from gi.repository import Atspi

    for value, enum in Atspi.StateType.__enum_values__.items():
        # ATSPI_STATE_MULTI_LINE -> multi_line, as pyatspi's StateType names give in OSWorld.
        _state_names[value] = enum.value_name.split("ATSPI_STATE_", 1)[1].lower()
    for value, enum in Atspi.Role.__enum_values__.items():
        _role_names[value] = Atspi.role_get_name(enum) or enum.value_nick.replace("-", " ")
    _role_ids.update({name: value for value, name in _role_names.items()})


def _clean(text: str) -> str:
    return _BAD_XML_CHARS.sub("", text)


def _xml_name(name: str) -> str:
    name = _BAD_NAME_CHARS.sub("-", name)
    if not name or not (name[0].isalpha() or name[0] == "_"):
        name = "_" + name
    return name


def _esc_text(s: str) -> str:
    return s.replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;").replace("\r", "&#13;")


def _esc_attr(s: str) -> str:
    return (
        _esc_text(s).replace('"', "&quot;").replace("\n", "&#10;").replace("\t", "&#9;")
    )


class _Node:
    """A tree element: tag, ordered attributes (already-prefixed names), text, children."""

    __slots__ = ("tag", "attrs", "text", "children")

    def __init__(self, tag: str, attrs: dict[str, str], text: str = "") -> None:  # noqa: D107
        self.tag = tag
        self.attrs = attrs
        self.text = text
        self.children: list[_Node] = []

    def write(self, out: list[str], root: bool = False) -> None:
        out.append("<" + self.tag)
        if root:
            for prefix, uri in NS.items():
                out.append(f' xmlns:{prefix}="{uri}"')
        for key, value in self.attrs.items():
            out.append(f' {key}="{_esc_attr(value)}"')
        if not self.text and not self.children:
            out.append("/>")
            return
        out.append(">")
        if self.text:
            out.append(_esc_text(self.text))
        for child in self.children:
            child.write(out)
        out.append(f"</{self.tag}>")




class _Call:
    """One D-Bus call in a batch; ``result`` is the unpacked reply, ``error`` an exception."""

    __slots__ = ("ref", "iface", "method", "args", "reply", "result", "error")

    def __init__(self, ref: Ref, iface: str, method: str, args: Any = None, reply: str | None = None) -> None:
        self.ref, self.iface, self.method, self.args, self.reply = ref, iface, method, args, reply
        self.result: Any = None
        self.error: Exception | None = None

    def ok(self, default: Any = None) -> Any:
        return default if self.error is not None or self.result is None else self.result


class _Walk:
    """One bounded traversal, breadth-first, with each level's D-Bus calls pipelined.

    Calls are sent asynchronously (up to ``_IN_FLIGHT`` outstanding) and their replies collected
    on a private GLib main context: one round trip costs ~0.3 ms, so waiting for each call in
    turn made a Calc tree take 15 s; pipelined it is a few seconds. Breadth-first also means a
    node or time budget cuts the deepest nodes of every app rather than whole late apps.
    """

    def __init__(self, bus: Bus, max_depth: int, max_width: int, max_nodes: int, timeout_s: float) -> None:
        self.bus = bus
        self.max_depth = max_depth
        self.max_width = max(0, max_width)
        self.max_nodes = max_nodes
        self.deadline = time.monotonic() + max(0.0, timeout_s)
        self.count = 0
        self.dead: set[str] = set()  # bus names of apps that timed out: not called again

    def left_ms(self) -> int:
        return int((self.deadline - time.monotonic()) * 1000)

    def run(self, calls: list[_Call]) -> None:
        """Send ``calls`` pipelined; return when all replied, failed or timed out."""
        from gi.repository import Gio, GLib

        todo = [c for c in calls if c.ref.name not in self.dead]
        for c in calls:
            if c.ref.name in self.dead:
                c.error = AppGone(c.ref.name)
        if not todo:
            return
        ctx = GLib.MainContext.new()
        ctx.push_thread_default()
        try:
            state = {"next": 0, "open": 0}
            conn = self.bus.conn

            def done(source: Any, res: Any, call: _Call) -> None:
                state["open"] -= 1
                try:
                    call.result = source.call_finish(res).unpack()
                except GLib.Error as err:
                    call.error = err
                    if is_gone(err):
                        self.dead.add(call.ref.name)
                except Exception as err:  # noqa: BLE001 - keep collecting the other replies
                    call.error = err

            while state["next"] < len(todo) or state["open"]:
                while state["next"] < len(todo) and state["open"] < _IN_FLIGHT:
                    c = todo[state["next"]]
                    state["next"] += 1
                    if c.ref.name in self.dead:
                        c.error = AppGone(c.ref.name)
                        continue
                    left = self.left_ms()
                    if left <= 0:  # out of time: the rest stay unanswered (partial tree)
                        c.error = TimeoutError()
                        continue
                    iface = c.iface if "." in c.iface else "org.a11y.atspi." + c.iface
                    conn.call(c.ref.name, c.ref.path, iface, c.method, c.args,
                              GLib.VariantType(c.reply) if c.reply else None,
                              Gio.DBusCallFlags.NONE, max(50, min(CALL_TIMEOUT_MS, left)), None, done, c)
                    state["open"] += 1
                if state["open"]:
                    # Blocks until a reply (or a call's own timeout) arrives: always bounded.
                    ctx.iteration(True)
        finally:
            ctx.pop_thread_default()

    # -- the walk -------------------------------------------------------------------------------

    def walk(self, apps: list[Ref], root: _Node) -> None:
        # Each frontier entry: (object, parent element, depth).
        frontier: list[tuple[Ref, _Node, int]] = [(app, root, 1) for app in apps]
        while frontier and self.left_ms() > 0 and self.count < self.max_nodes:
            frontier = frontier[: self.max_nodes - self.count]
            self.count += len(frontier)
            frontier = self.level(frontier)

    def level(self, frontier: list[tuple[Ref, _Node, int]]) -> list[tuple[Ref, _Node, int]]:
        # Phase 1: what every node needs.
        base = []
        for ref, _, _ in frontier:
            # Never Properties.GetAll: atk-bridge 2.46 in Chromium writes an invalid GetAll reply
            # (a property with no GValue type) and libdbus aborts Chromium. Get them one by one.
            base.append((
                _Call(ref, PROPERTIES, "Get", variant("(ss)", ACCESSIBLE, "Name"), "(v)"),
                _Call(ref, PROPERTIES, "Get", variant("(ss)", ACCESSIBLE, "ChildCount"), "(v)"),
                _Call(ref, "Accessible", "GetState", None, "(au)"),
                _Call(ref, "Accessible", "GetAttributes", None, "(a{ss})"),
                _Call(ref, "Accessible", "GetInterfaces", None, "(as)"),
                _Call(ref, "Accessible", "GetRole", None, "(u)"),
            ))
        self.run([c for calls in base for c in calls])

        # Phase 2: per-interface details and the children, from what phase 1 said.
        nodes: list[tuple[_Node, dict[str, _Call], list[_Call], int] | None] = []
        extra: list[_Call] = []
        big_tables: list[tuple[Ref, _Node, int]] = []
        for (ref, parent, depth), (name_c, count_c, state_c, attrs_c, ifaces_c, role_c) in zip(frontier, base,
                                                                                                strict=True):
            name = name_c.ok()
            if name is None:  # the app is gone or the object vanished: leave it out
                nodes.append(None)
                continue
            attrs: dict[str, str] = {"name": _clean(str(name[0] or ""))}
            words = state_c.ok(([],))[0]
            states = {32 * i + b for i, w in enumerate(words) for b in range(32) if w >> b & 1}
            for st in sorted(states):  # enum order, as pyatspi lists them
                if st in _state_names:
                    attrs["st:" + _state_names[st]] = "true"
            for key, value in attrs_c.ok(({},))[0].items():
                if key:
                    attrs["attr:" + _xml_name(key)] = _clean(str(value))
            ifaces = {i.rsplit(".", 1)[-1] for i in ifaces_c.ok(([],))[0]}
            role = _role_names.get(role_c.ok((0,))[0]) or "unknown"
            tag = _xml_name(role.strip().replace(" ", "-") or "unknown")
            xml = _Node(tag, attrs)
            parent.children.append(xml)

            more: dict[str, _Call] = {}
            if "Component" in ifaces and _STATE_VISIBLE in states and _STATE_SHOWING in states:
                more["ext"] = _Call(ref, "Component", "GetExtents", variant("(u)", _COORD_SCREEN), "((iiii))")
            if "Text" in ifaces:
                more["text"] = _Call(ref, "Text", "GetText", variant("(ii)", 0, -1), "(s)")
            if "Value" in ifaces:
                for key, prop in _VALUE_PROPS:
                    more["val:" + key] = _Call(ref, PROPERTIES, "Get", variant("(ss)", "org.a11y.atspi.Value", prop),
                                               "(v)")
            if "Action" in ifaces:
                more["actions"] = _Call(ref, "Action", "GetActions", None, "(a(sss))")
            if "Document" in ifaces:
                more["locale"] = _Call(ref, "Document", "GetLocale", None, "(s)")
                more["docattrs"] = _Call(ref, "Document", "GetAttributes", None, "(a{ss})")
            if "Image" in ifaces:
                attrs["image"] = "true"
            if "Selection" in ifaces:
                attrs["selection"] = "true"

            kids: list[_Call] = []
            count = int(count_c.ok((0,))[0] or 0)
            if depth < self.max_depth and count > 0 and _STATE_DEFUNCT not in states:
                if count > self.max_width and tag in ("table", "tree-table"):
                    big_tables.append((ref, xml, depth))
                elif count <= self.max_width:
                    kids.append(_Call(ref, "Accessible", "GetChildren", None, "(a(so))"))
                else:
                    kids = [_Call(ref, "Accessible", "GetChildAtIndex", variant("(i)", i), "((so))")
                            for i in range(self.max_width)]
            nodes.append((xml, more, kids, depth))
            extra += list(more.values()) + kids
        self.run(extra)

        nxt: list[tuple[Ref, _Node, int]] = []
        for entry in nodes:
            if entry is None:
                continue
            xml, more, kids, depth = entry
            self.fill(xml, more)
            for call in kids:
                got = call.ok()
                if got is None:
                    continue
                sos = got[0] if call.method == "GetChildren" else [got[0]]
                for so in sos[: self.max_width]:
                    child = call.ref.ref(so)
                    if child is not None:
                        nxt.append((child, xml, depth + 1))
        for ref, xml, depth in big_tables:
            nxt += [(cell, xml, depth + 1) for cell in self.visible_cells(ref)]
        return nxt

    @staticmethod
    def fill(xml: _Node, more: dict[str, _Call]) -> None:
        attrs = xml.attrs
        if "ext" in more and more["ext"].ok() is not None:
            x, y, w, h = more["ext"].result[0]
            attrs["cp:screencoord"] = f"({x}, {y})"
            attrs["cp:size"] = f"({w}, {h})"
        if "text" in more and more["text"].ok() is not None:
            xml.text = _clean(more["text"].result[0][:_MAX_TEXT_CHARS])
        for key, _prop in _VALUE_PROPS:
            if "val:" + key in more and more["val:" + key].ok() is not None:
                attrs["val:" + key] = str(more["val:" + key].result[0])
        if "actions" in more:
            for act_name, desc, keys in more["actions"].ok(([],))[0][:32]:
                act = _xml_name(act_name.replace(" ", "-"))
                attrs[f"act:{act}_desc"] = _clean(desc)
                attrs[f"act:{act}_kb"] = _clean(keys)
        if "locale" in more and more["locale"].ok(("",))[0]:
            attrs["doc:locale"] = _clean(more["locale"].result[0])
        if "docattrs" in more:
            for key, value in more["docattrs"].ok(({},))[0].items():
                if key:
                    attrs["docattr:" + _xml_name(key)] = _clean(str(value))

    # -- huge tables ----------------------------------------------------------------------------

    def one(self, ref: Ref, iface: str, method: str, args: Any, reply: str) -> Any:
        call = _Call(ref, iface, method, args, reply)
        self.run([call])
        return call.ok()

    def visible_cells(self, table: Ref) -> list[Ref]:
        """Only the cells in a huge table's visible window (Calc has 16384 x 1048576 cells).

        The cells under the table's top-left and bottom-right visible corners give the row and
        column range; the cells are then fetched by (row, column), row-major like OSWorld.
        """
        ext = self.one(table, "Component", "GetExtents", variant("(u)", _COORD_SCREEN), "((iiii))")
        if ext is None:
            return []
        x, y, w, h = ext[0]
        if w <= 2 or h <= 2:
            return []
        first = self.cell_pos(table, x + 1, y + 1)
        last = self.cell_pos(table, x + w - 2, y + h - 2)
        if first is None or last is None:
            return []
        (r0, c0), (r1, c1) = first, last
        if r1 < r0 or c1 < c0:
            return []
        calls = [_Call(table, "Table", "GetAccessibleAt", variant("(ii)", r, c), "((so))")
                 for r in range(r0, r1 + 1) for c in range(c0, c1 + 1)]
        self.run(calls[: max(0, self.max_nodes - self.count)])
        cells = [table.ref(c.result[0]) for c in calls if c.ok() is not None]
        return [c for c in cells if c is not None]

    def cell_pos(self, table: Ref, x: int, y: int) -> tuple[int, int] | None:
        got = self.one(table, "Component", "GetAccessibleAtPoint", variant("(iiu)", x, y, _COORD_SCREEN), "((so))")
        cell = table.ref(got[0]) if got else None
        if cell is None:
            return None
        # Calc names cells "B7": parse that, as the child index overflows int32 past row 131072.
        name = self.one(cell, PROPERTIES, "Get", variant("(ss)", ACCESSIBLE, "Name"), "(v)")
        m = _CELL_NAME.match(str(name[0]) if name else "")
        if m:
            col = 0
            for ch in m.group(1):
                col = col * 26 + (ord(ch) - 64)
            return int(m.group(2)) - 1, col - 1
        idx = self.one(cell, "Accessible", "GetIndexInParent", None, "(i)")
        if not idx or idx[0] < 0:
            return None
        row = self.one(table, "Table", "GetRowAtIndex", variant("(i)", idx[0]), "(i)")
        col = self.one(table, "Table", "GetColumnAtIndex", variant("(i)", idx[0]), "(i)")
        return (row[0], col[0]) if row and col and row[0] >= 0 and col[0] >= 0 else None


def _applications(bus: Bus, timeout_ms: int) -> list[Ref]:
    registered = bus.call(REGISTRY, ROOT_PATH, ACCESSIBLE, "GetChildren",
                          None, "(a(so))", timeout_ms)[0]
    return [Ref(bus, name, path) for name, path in registered if name and path != NULL_PATH]


def accessibility_tree(
    max_depth: int = 50, max_width: int = 1024, max_nodes: int = 5000, timeout_s: float = 10.0
) -> str:
    """The desktop's accessibility tree as OSWorld-style XML (see the module docstring).

    Applications are depth 1 (as in OSWorld); nodes at ``max_depth`` are kept without children.
    At most ``max_width`` children per node (the visible cells for huge tables), ``max_nodes``
    nodes in all, and the walk stops at ``timeout_s`` (plus at most one in-flight call's 50 ms
    floor); the partial tree is still well-formed. An application that does not answer within
    the per-call timeout (1.5 s) is cut off where it stopped. Returns an empty
    ``<desktop-frame>`` when the AT-SPI bus cannot be reached.
    """
    root = _Node("desktop-frame", {})
    with _LOCK:
        try:
            _tables()
            bus = get_bus()
            walk = _Walk(bus, max_depth, max_width, max_nodes, timeout_s)
            walk.walk(_applications(bus, max(50, min(1000, walk.left_ms()))), root)
        except Exception:
            pass  # no bus, or something unforeseen: what was built is still well-formed
    out: list[str] = []
    root.write(out, root=True)
    return "".join(out)


def terminal_text() -> str | None:
    """Text of the focused terminal widget in the active window (any app: xfce4-terminal,
    gnome-terminal, ...), right-stripped, like OSWorld's ``/terminal``; None when there is none.
    """
    with _LOCK:
        try:
            _tables()
            bus = get_bus()
            deadline = time.monotonic() + 5.0
            found: list[Ref] = []
            for app in _applications(bus, 1000):
                try:
                    frames = app.call("Accessible", "GetChildren", None, "(a(so))", 1000)[0]
                    for so in frames[:64]:
                        frame = app.ref(so)
                        if frame is not None and _has_state(frame, _STATE_ACTIVE):
                            _find_terminals(frame, found, 0, deadline)
                except Exception:
                    continue  # a hung or vanished app has no focused terminal we can read
            if len(found) != 1:
                return None
            text = found[0].call("Text", "GetText", variant("(ii)", 0, -1), "(s)", 2000)[0]
            return _clean(text).rstrip()
        except Exception:
            return None


def _has_state(ref: Ref, state: int) -> bool:
    words = ref.call("Accessible", "GetState", None, "(au)", 1000)[0]
    return len(words) > state // 32 and bool(words[state // 32] >> (state % 32) & 1)


def _find_terminals(ref: Ref, found: list[Ref], depth: int, deadline: float) -> None:
    if depth > 30 or time.monotonic() > deadline:
        return
    if ref.call("Accessible", "GetRole", None, "(u)", 1000)[0] == _role_ids["terminal"]:
        if _has_state(ref, _STATE_FOCUSED):
            found.append(ref)
        return
    count = int(ref.call(PROPERTIES, "Get", variant("(ss)", ACCESSIBLE, "ChildCount"), "(v)", 1000)[0] or 0)
    if count <= 0 or count > 256:
        return
    for so in ref.call("Accessible", "GetChildren", None, "(a(so))", 1000)[0]:
        child = ref.ref(so)
        if child is not None:
            _find_terminals(child, found, depth + 1, deadline)
