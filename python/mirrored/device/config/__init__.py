"""``md.config``: TensorFlow's ``tf.config`` (devices, their visibility and logical split, memory, threads, eager
functions), plus what this installation can do (``is_cuda_available``, ``is_nccl_available``, ``is_gloo_available``,
``engine_name``). docs/config.md has the guide::

    md.config.set_visible_devices([], "GPU")         # strategies run on the CPU
    gpu, = md.config.list_physical_devices("GPU")
    md.config.set_logical_device_configuration(
        gpu, [md.config.LogicalDeviceConfiguration()] * 2)
    # shorthand: md.config.set_logical_device_configuration("GPU", 0, count=2)
    md.config.list_logical_devices("GPU")   # GPU:0 and GPU:1, both on physical GPU 0

Unlike TensorFlow, devices may be hidden or split at any time; a change applies to strategies created afterwards.
``memory_limit`` is recorded, not enforced (cap CuPy with ``cupy.get_default_memory_pool().set_limit``).
"""

from ..engine import name as engine_name
from . import experimental, threading
from ._devices import (LogicalDevice, LogicalDeviceConfiguration, PhysicalDevice,
                       LogicalDeviceConfiguration as VirtualDeviceConfiguration, get_logical_device_configuration,
                       get_visible_devices, hidden_note, list_logical_devices, list_physical_devices, num_gpus,
                       physical_gpu_index, set_logical_device_configuration, set_visible_devices)
from ._execution import (experimental_functions_run_eagerly, experimental_run_functions_eagerly,
                         functions_run_eagerly, get_soft_device_placement, run_functions_eagerly,
                         set_soft_device_placement)
from ._installation import (GLOO_NOT_BUILT, is_cuda_available, is_gloo_available, is_nccl_available,
                            net_load_error, net_module)

__all__ = [  # TF's tf.config names, then ours (docs/config.md)
    "LogicalDevice", "LogicalDeviceConfiguration", "PhysicalDevice", "experimental",
    "experimental_functions_run_eagerly", "experimental_run_functions_eagerly", "functions_run_eagerly",
    "get_logical_device_configuration", "get_soft_device_placement", "get_visible_devices", "list_logical_devices",
    "list_physical_devices", "run_functions_eagerly", "set_logical_device_configuration", "set_soft_device_placement",
    "set_visible_devices", "threading",
    "VirtualDeviceConfiguration", "engine_name", "is_cuda_available", "is_gloo_available", "is_nccl_available",
    "num_gpus", "physical_gpu_index", "hidden_note", "net_module", "net_load_error", "GLOO_NOT_BUILT",
]
