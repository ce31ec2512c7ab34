"""The accessibility tree as text a model can read: one tab-separated line per visible node.

The desktop sends AT-SPI as OSWorld's XML (``osfarm.desktop.session.a11y``); agents in OSWorld linearise
it into a table ``tag, name, text, class, description, position (top-left x&y), size (w&h)``,
keeping only nodes that are showing on screen and carry a name or text. This module does the
same from our XML, and clips the result to a character budget (the tree of a busy app can be
far larger than a model's context).
"""

from __future__ import annotations

import re
import xml.etree.ElementTree as ET

NS_STATE = "https://accessibility.ubuntu.example.org/ns/state"
NS_ATTR = "https://accessibility.ubuntu.example.org/ns/attributes"
NS_COMP = "https://accessibility.ubuntu.example.org/ns/component"
HEADER = "tag\tname\ttext\tclass\tdescription\tposition (top-left x&y)\tsize (w&h)"
# Roles whose nodes are shown even without a name: the controls an agent clicks.
INTERACTIVE = ("button", "push-button", "check-box", "radio-button", "combo-box", "menu-item", "entry",
               "text", "link", "toggle-button", "spin-button", "table-cell", "tab", "icon", "slider",
               "list-item", "menu", "document-text", "paragraph", "heading")
_PAIR = re.compile(r"\(\s*(-?\d+)\s*,\s*(-?\d+)\s*\)")


def _pair(s: str | None) -> tuple[int, int] | None:
    m = _PAIR.fullmatch(s.strip()) if s else None
    return (int(m.group(1)), int(m.group(2))) if m else None


def _keep(node: ET.Element) -> bool:
    if node.get(f"{{{NS_STATE}}}showing") != "true" and node.get(f"{{{NS_STATE}}}visible") != "true":
        return False
    pos, size = _pair(node.get(f"{{{NS_COMP}}}screencoord")), _pair(node.get(f"{{{NS_COMP}}}size"))
    if pos is None or size is None or size[0] <= 0 or size[1] <= 0 or pos[0] < 0 or pos[1] < 0:
        return False
    text = (node.text or "").strip()
    return bool(node.get("name") or text or node.tag in INTERACTIVE)


def _cell(s: str | None) -> str:
    return (s or "").replace("\t", " ").replace("\n", "\\n").strip()


def linearize(xml: str | None, max_chars: int = 20_000) -> str:
    """The table for ``xml`` (empty string for no tree); clipped to ``max_chars`` with a note."""
    if not xml:
        return ""
    try:
        root = ET.fromstring(xml)
    except ET.ParseError as e:
        return f"(accessibility tree unreadable: {e})"
    lines = [HEADER]
    size = len(HEADER)
    for node in root.iter():
        if node is root or not _keep(node):
            continue
        text = _cell(node.text)
        if len(text) > 200:
            text = text[:200] + "..."
        line = "\t".join([node.tag, _cell(node.get("name")), text, _cell(node.get(f"{{{NS_ATTR}}}class")),
                          _cell(node.get(f"{{{NS_ATTR}}}description") or node.get("description")),
                          node.get(f"{{{NS_COMP}}}screencoord", ""), node.get(f"{{{NS_COMP}}}size", "")])
        if size + len(line) + 1 > max_chars:
            lines.append("[... accessibility tree truncated]")
            break
        lines.append(line)
        size += len(line) + 1
    return "\n".join(lines)
