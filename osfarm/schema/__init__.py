"""The one typed wire layer: every model that crosses a process boundary, split by concept.

* :mod:`~osfarm.schema.actions`: the action vocabulary (computer_13 objects, pyautogui code) and
  its parser;
* :mod:`~osfarm.schema.observation`: what a desktop shows (on the wire, and as an agent is handed
  it) and the options that ask for it;
* :mod:`~osfarm.schema.guest`: the guest's native ``/v1`` step, code and wait models;
* :mod:`~osfarm.schema.lease`, :mod:`~osfarm.schema.pool`, :mod:`~osfarm.schema.service`: the
  farm's leases, pool status, whoami/healthz and error body;
* :mod:`~osfarm.schema.task_run`: the answers of the farm's task reset and evaluate routes;
* :mod:`~osfarm.schema.episode`: the ``osfarm.episode/1`` trajectory record.

The guest server, the farm, the client, ``TaskEnv``, the stream, the runner and the trainer all
speak these; dicts are left only at the OSWorld-compatible edges (OSWorld's guest routes, task
JSON, OSWorld's observation dict). The layer imports nothing of osfarm but :mod:`osfarm.errors`
(``tests/test_layers.py``).
"""
