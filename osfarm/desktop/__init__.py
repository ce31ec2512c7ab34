"""Runs inside a desktop: session launcher, guest server, capture, input, a11y."""
