"""The training app: ``python -m ddp_plugins.train`` (Hydra), its up-front checks and the demo model and data.

Example::

    >>> from ddp_plugins.app.checks import ConfigError, compose_config
    >>> compose_config(["backend=gloo"]).backend.name
    'gloo'
    >>> try:
    ...     compose_config(["backend=carrier_pigeon"])
    ... except ConfigError as err:
    ...     print(str(err).split(":")[0])
    override was refused by Hydra
"""
