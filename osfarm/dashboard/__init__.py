"""The web dashboard: live desktops of a farm (pool page, live view, take-over) and the eval and
training runs of a runs dir (leaderboard, run, episode, compare, training charts), served under
``/ui`` by the farm or by ``osfarm ui``, or exported as a static site (``osfarm report export``).
See docs/dashboard.md."""
