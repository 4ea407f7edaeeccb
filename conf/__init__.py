"""Hydra configs of the training app, shipped in the wheel as ``ddp_plugins.conf``.

Example::

    >>> import importlib.resources
    >>> configs = importlib.resources.files("ddp_plugins.conf")
    >>> (configs / "train.yaml").is_file(), sorted(p.name for p in (configs / "backend").iterdir())
    (True, ['auto.yaml', 'gloo.yaml', 'mpi.yaml', 'nccl.yaml'])
"""
