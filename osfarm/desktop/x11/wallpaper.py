"""The desktop's wallpaper: an image scaled over the X root window (``/setup/change_wallpaper``)."""

from __future__ import annotations

from typing import IO

from PIL import Image
from Xlib import X, Xatom
from Xlib import display as xdisplay


def paint_root(display: str, path: str | IO[bytes]) -> None:
    """Scale an image over the root window (what feh/hsetroot do), so screenshots show it.

    The pixmap is kept after our connection closes (RetainPermanent) and published in
    _XROOTPMAP_ID like other setters, so compositing apps and panels pick it up. ``path`` may be
    an open binary file. Raises OSError when the file is not an image PIL can read.
    """
    d = xdisplay.Display(display)
    try:
        screen = d.screen()
        root = screen.root
        w, h = screen.width_in_pixels, screen.height_in_pixels
        with Image.open(path) as src:
            img = src.convert("RGB")
        # cover the screen, cropping the overflow (GNOME's default "zoom")
        ratio = max(w / img.width, h / img.height)
        img = img.resize((max(w, round(img.width * ratio)), max(h, round(img.height * ratio))))
        left, top = (img.width - w) // 2, (img.height - h) // 2
        img = img.crop((left, top, left + w, top + h))
        depth = screen.root_depth
        if depth not in (24, 32):
            return  # 16-bit visuals would need a different pixel packing; leave the root as is
        pix = root.create_pixmap(w, h, depth)
        gc = pix.create_gc()
        data = img.tobytes("raw", "BGRX")
        rows = max(1, 200_000 // (w * 4))  # stay well below the maximum X request size
        for y in range(0, h, rows):
            n = min(rows, h - y)
            pix.put_image(gc, 0, y, w, n, X.ZPixmap, depth, 0, data[y * w * 4:(y + n) * w * 4])
        # Free the pixmap of the previous wallpaper (kept alive by RetainPermanent).
        old = root.get_full_property(d.intern_atom("_XROOTPMAP_ID"), Xatom.PIXMAP)
        if old is not None and old.value and old.value[0] != pix.id:
            try:
                d.kill_client(old.value[0])
            except Exception:
                pass
        for name in ("_XROOTPMAP_ID", "ESETROOT_PMAP_ID"):
            root.change_property(d.intern_atom(name), Xatom.PIXMAP, 32, [pix.id])
        root.change_attributes(background_pixmap=pix)
        root.clear_area(0, 0, w, h)
        d.set_close_down_mode(X.RetainPermanent)
        d.sync()
    finally:
        d.close()
