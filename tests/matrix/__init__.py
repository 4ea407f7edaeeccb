"""The promise matrix (tests/matrix/table.py) and its jobs."""
