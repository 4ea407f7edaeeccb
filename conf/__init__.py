"""Hydra configs of the training app, shipped in the wheel as ``ddp_plugins.conf``."""
