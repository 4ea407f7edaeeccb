"""The training app
================

``python -m ddp_plugins.train`` (Hydra), its up-front checks, and the demo model and data.
"""
