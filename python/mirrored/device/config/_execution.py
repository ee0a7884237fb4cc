"""How steps run: eagerly or captured (``md.function``), and TF's soft device placement."""

_flags = {"run_functions_eagerly": False, "soft_device_placement": True}


def run_functions_eagerly(run_eagerly) -> None:
    """``True``: every ``md.function`` runs its Python function eagerly at each call, with no capture and no reuse
    of an earlier trace (for debugging with prints and breakpoints); ``False``: captured steps again."""
    _flags["run_functions_eagerly"] = bool(run_eagerly)


def functions_run_eagerly() -> bool:
    """Whether :func:`run_functions_eagerly` is on."""
    return _flags["run_functions_eagerly"]


def experimental_run_functions_eagerly(run_eagerly) -> None:
    """TF's older name of :func:`run_functions_eagerly`."""
    run_functions_eagerly(run_eagerly)


def experimental_functions_run_eagerly() -> bool:
    """TF's older name of :func:`functions_run_eagerly`."""
    return functions_run_eagerly()


def set_soft_device_placement(enabled) -> None:
    """TF's soft placement flag, kept and reported. There is no op to move here: work runs where the strategy puts
    each replica (its device scope), and a device this machine lacks is an error either way."""
    _flags["soft_device_placement"] = bool(enabled)


def get_soft_device_placement() -> bool:
    """The soft placement flag (True unless set, as TF's)."""
    return _flags["soft_device_placement"]
