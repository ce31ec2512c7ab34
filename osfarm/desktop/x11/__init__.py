"""The X display, read and driven in-process: the Xvfb server, XTest input, screen capture and
recording, EWMH windows, the server's state readers (properties, XKB, XSETTINGS), the wallpaper
and ``osfarm-settle``. Imports nothing of the other desktop subpackages."""
