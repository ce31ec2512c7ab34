"""Where episodes run: in the runner's own event loop (run.py, the default) or on Celery
workers bound to farms (celery_app.py: the app and its ``run_episode`` task; celery_exec.py:
the runner's side; worker.py: ``osfarm worker``)."""
