"""OSWorld-compatible evaluation: getters fetch state from a desktop, metrics score it, and
``scoring.score`` combines the metric scores exactly as OSWorld's ``DesktopEnv.evaluate`` does.

* ``getters``: ``GETTERS[type](env, config)``, the state an evaluator entry names;
* ``metrics``: ``METRICS[func](result[, expected], **options)``, a score in [0, 1];
* ``scoring``: ``score(evaluator, results, expecteds, last_action, METRICS)``, the task's score;
* ``errors``: what a task's evaluator configuration can get wrong (raised, never scored).

Importing this package loads nothing: the metric registry pulls in the office-file and image
libraries, so only code that scores imports it.
"""
