"""What a provider starts in its box: the desktop session launcher (``python -m
osfarm.desktop.launch.launcher``) and the sandbox's box template that forks boxes
(``box_zygote``). The top of the desktop layer: it starts the session and the guest server."""
