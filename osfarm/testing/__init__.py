"""Helpers for testing against osfarm with real parts, shared by osfarm's own tests, ``bench/``
and users' tests (like ``numpy.testing``: installed with the package, so ``import osfarm.testing``
needs no ``sys.path`` change and no checkout).

One way to start a farm: :func:`osfarm.testing.farms.running_farm` (in this process, or with
``process=True`` as an ``osfarm serve`` process that a test can kill and restart). The rest, one
idea a module:

* ``farms``: the test farm's settings and ``running_farm``; ``farm_process``: the farm as a process.
* ``memory_provider`` / ``memory_farm``: a provider whose boxes are tiny in-process HTTP servers,
  and a farm process over them (leases by the thousand, no desktop).
* ``boxes``: one throwaway sandbox desktop; the processes of boxes (to prove none is left).
* ``redis_server``: a throwaway ``redis-server``; ``docker_env``: the docker daemon and osfarm's images.
* ``waiting``: poll for a condition instead of sleeping; ``ports``: a free loopback port.
* ``provider_options``: each provider's settings here, its image or VM disk built when missing.
* ``vlm_servers``: the CPU policy server with the tiny model, and a fault-injecting proxy before
  it; ``lora_adapters``: LoRA adapters for that model.
* ``asset_server``: a local HTTP server of task files (ranges, ETags, faults); ``dashboard_runs``:
  run folders for the dashboard to show.
* ``chaos_cluster``: Redis + farm + Celery workers a chaos run kills; ``redteam``: the red team's
  probes, adversarial agent and farm.
* ``unavailable``: a missing tool skips the test under pytest, and raises elsewhere.

Nothing here imports pytest: a missing tool (Redis, docker) skips the running test when pytest
has been imported, else raises :class:`~osfarm.testing.unavailable.Unavailable`. Nothing else
of osfarm imports this package.
"""
