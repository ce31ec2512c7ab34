"""The benchmark harness: episodes (episode.py), whole runs (run.py), what they write (results.py).

Import from the submodules; this package stays empty so that `osfarm --help` does not load the
evaluators (pandas, office libraries) it never needs.
"""
