"""``python -m osfarm.cli``: the ``osfarm`` command."""

from osfarm.cli import main

main()
