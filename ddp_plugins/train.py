"""``python -m ddp_plugins.train``: the training app's entry point (see :mod:`ddp_plugins.app.train`).

A module of its own so that the command stays short and child ranks re-run it by this name. It
imports the app only when it runs: a DataLoader worker re-imports the main module by name, and
should not import Lightning for it.

Example::

    >>> from ddp_plugins import train
    >>> train.main.__doc__
    'Run the app (:func:`ddp_plugins.app.train.main`).'
"""


def main() -> None:
    """Run the app (:func:`ddp_plugins.app.train.main`)."""
    from ddp_plugins.app.train import main as app_main

    app_main()


if __name__ == "__main__":
    main()
