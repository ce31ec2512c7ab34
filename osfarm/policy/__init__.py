"""The policy side of osfarm: a CPU policy server with an OpenAI-compatible API subset.

* ``tiny``       a randomly initialised Qwen2-VL-architecture model built locally (no download)
* ``processing`` OpenAI chat messages -> model inputs (chat template, images, image tokens)
* ``sampling``   the token distribution we sample from and report log-probs of
* ``engine``     the model, its policy version, generation and atomic weight reloads
* ``server``     the FastAPI app (``/v1/models``, ``/v1/chat/completions``, ``/v1/weights/reload``)
* ``cli``        ``osfarm policy serve``
* ``client``     a running server as its users see it (``PolicyServer``, ``wait_healthy``)
* ``process``    ``osfarm policy serve`` as a subprocess on a free port (``PolicyProcess``)

torch and transformers are imported lazily (the ``policy`` extra), so importing this package
costs nothing for the rest of osfarm.
"""
