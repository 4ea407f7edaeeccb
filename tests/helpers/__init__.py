"""Test harness: real gloo process groups on 127.0.0.1, each run under a hard timeout."""
