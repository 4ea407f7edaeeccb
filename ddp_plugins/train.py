"""``python -m ddp_plugins.train``: the training app's entry point (see :mod:`ddp_plugins.app.train`).

A module of its own so that the command stays short and child ranks re-run it by this name.

Example::

    >>> from ddp_plugins import train
    >>> train.main.__module__  # importing it starts nothing; `main` is the app's
    'ddp_plugins.app.train'
"""

from ddp_plugins.app.train import main

if __name__ == "__main__":
    main()
