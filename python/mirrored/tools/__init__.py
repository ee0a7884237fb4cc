"""Command-line tools: the launcher (``mirrored-run``), the benchmark CLI and ``info``.

The top layer: each may use every other layer; nothing imports it.
"""
