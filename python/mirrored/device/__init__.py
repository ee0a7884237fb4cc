"""Devices: TF device names, ``md.config`` (physical/logical devices), GPU access, dtypes and DLPack.

The lowest layer of the package: nothing here imports the collective,
distribute, train or data layers.
"""
