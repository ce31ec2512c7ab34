"""Warm reset: the desktop's fingerprint, the baseline taken once a cold start is ready and its
restore (kill rounds, the home's snapshot by the agent-side root helper, the X server's state put
back). Built on ``session``, ``x11`` and ``box``."""
