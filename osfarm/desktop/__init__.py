"""Runs inside a desktop, one subpackage per concept, each importing only those before it::

    x11, box -> session -> warm -> guest -> launch

``x11`` (the X display: Xvfb, input, capture, windows, X state readers), ``box`` (the box's init
and the agent's world), ``session`` (the light or GNOME desktop, accessibility, the routes' shared
Desktop), ``warm`` (fingerprint and warm reset), ``guest`` (the guest HTTP server), ``launch``
(the session launcher and the sandbox's box template). tests/test_layers.py holds the direction."""
