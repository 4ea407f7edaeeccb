"""``python -m ddp_plugins.train``: the training app's entry point (see :mod:`ddp_plugins.app.train`).

Child ranks re-run it by this name; the app is imported in :func:`main`: loader workers re-import it without Lightning.

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
