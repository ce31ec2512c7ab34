"""The red team, shared by tests/security and bench/redteam.py: the probes (``probes``: one
registry; ``warm_probes``: warm-reset persistence), the adversarial agent that plays them
(``adversary``) and the farm they run on, next to a bystander desktop (``farm``)."""
