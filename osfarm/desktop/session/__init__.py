"""One desktop session on the X display and in the box: the light or GNOME desktop, the home's
settings, the accessibility bus and tree, and the :class:`~osfarm.desktop.session.guest_state.Desktop`
handle the guest's routes share. Built on ``x11`` and ``box``."""
