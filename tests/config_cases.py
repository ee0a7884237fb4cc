"""Scenarios over ``config`` (``tf.config`` or ``md.config``), evaluated by tests/data/record_tf_config.py with
TensorFlow 2.21 (each scenario in a process of its own: TF fixes its devices at their first use) and by
tests/test_config.py with mirrored's: the repr of each expression's result, or the error it raises, must agree.

Names the expressions may use: ``config``; ``cpu()``, the physical CPU; ``phantom_gpu``, a PhysicalDevice of a GPU
the machine lacks (neither side has a GPU when recording). Expressions run in order, sharing the scenario's state."""

SCENARIOS = {
    "device_types": [
        "config.list_physical_devices()", "config.list_physical_devices('CPU')", "config.list_physical_devices('GPU')",
        "config.list_physical_devices('TPU')", "config.list_physical_devices('XLA_CPU')",
        "config.list_physical_devices('tpu')", "config.list_physical_devices('cpu')",
        "config.list_physical_devices('')", "config.get_visible_devices()", "config.get_visible_devices('CPU')",
        "config.get_visible_devices('GPU')", "config.get_visible_devices('TPU')", "config.get_visible_devices('cpu')",
        "config.experimental.list_physical_devices('CPU')", "config.experimental.get_visible_devices('CPU')",
        "config.list_logical_devices('TPU')", "config.list_logical_devices('cpu')", "config.list_logical_devices()",
        "config.list_logical_devices('CPU')", "config.experimental.list_logical_devices('CPU')",
    ],
    "hide_gpus": [
        "config.set_visible_devices([], 'GPU')", "config.get_visible_devices()", "config.get_visible_devices('GPU')",
        "config.list_logical_devices('GPU')", "config.list_logical_devices()",
    ],
    "hide_tpus": ["config.set_visible_devices([], 'TPU')", "config.get_visible_devices()"],
    "hide_cpu": ["config.set_visible_devices([], 'CPU')", "config.get_visible_devices()"],
    "hide_all": ["config.set_visible_devices([])", "config.get_visible_devices()"],
    "visible_cpu_alone": ["config.set_visible_devices(cpu())", "config.get_visible_devices()",
                          "config.set_visible_devices([cpu()], 'CPU')", "config.get_visible_devices('CPU')",
                          "config.list_logical_devices()"],
    "visible_bad_devices": [
        "config.set_visible_devices([cpu()], 'GPU')", "config.set_visible_devices('CPU:0')",
        "config.set_visible_devices(['/physical_device:CPU:0'])", "config.set_visible_devices([phantom_gpu], 'GPU')",
        "config.set_visible_devices([cpu()], 'cpu')", "config.get_visible_devices()",
        "config.experimental.set_visible_devices([], 'GPU')",
    ],
    "memory_growth": [
        "config.experimental.get_memory_growth(cpu())", "config.experimental.set_memory_growth(cpu(), True)",
        "config.experimental.get_memory_growth(phantom_gpu)",
        "config.experimental.set_memory_growth(phantom_gpu, True)",
        "config.experimental.get_memory_growth('GPU:0')", "config.experimental.set_memory_growth('CPU:0', True)",
    ],
    "memory_growth_of_split_cpu": [
        "config.set_logical_device_configuration(cpu(), [config.LogicalDeviceConfiguration()] * 2)",
        "config.experimental.set_memory_growth(cpu(), True)",
        "config.experimental.get_virtual_device_configuration(cpu())",
        "config.list_logical_devices('CPU')",
    ],
    "virtual_device_aliases": [
        "config.experimental.set_virtual_device_configuration("
        "cpu(), [config.experimental.VirtualDeviceConfiguration()] * 3)",
        "config.get_logical_device_configuration(cpu())", "len(config.list_logical_devices('CPU'))",
        "config.experimental.VirtualDeviceConfiguration is config.LogicalDeviceConfiguration",
    ],
    "device_details": [
        "config.experimental.get_device_details(cpu())", "config.experimental.get_device_details('CPU:0')",
        "config.experimental.get_device_details(phantom_gpu)", "config.experimental.get_device_details(None)",
    ],
    "memory_info": [
        "config.experimental.get_memory_info('CPU:0')", "config.experimental.get_memory_info('/device:CPU:0')",
        "config.experimental.get_memory_info('/job:localhost/replica:0/task:0/device:CPU:0')",
        "config.experimental.get_memory_info('GPU:0')", "config.experimental.get_memory_info('CPU:1')",
        "config.experimental.get_memory_info('XYZ:0')", "config.experimental.reset_memory_stats('CPU:0')",
        "config.experimental.reset_memory_stats('GPU:0')", "config.experimental.get_memory_usage('CPU:0')",
        "config.experimental.get_memory_usage('GPU:0')",
    ],
    "eager_functions": [
        "config.functions_run_eagerly()", "config.run_functions_eagerly(1)", "config.functions_run_eagerly()",
        "config.experimental_functions_run_eagerly()", "config.run_functions_eagerly(False)",
        "config.functions_run_eagerly()", "config.experimental_run_functions_eagerly(True)",
        "config.functions_run_eagerly()", "config.run_functions_eagerly(None)", "config.functions_run_eagerly()",
    ],
    "soft_placement": [
        "config.get_soft_device_placement()", "config.set_soft_device_placement(False)",
        "config.get_soft_device_placement()", "config.set_soft_device_placement(1)",
        "config.get_soft_device_placement()",
    ],
    "threads": [
        "config.threading.get_inter_op_parallelism_threads()", "config.threading.get_intra_op_parallelism_threads()",
        "config.threading.set_inter_op_parallelism_threads(2)", "config.threading.get_inter_op_parallelism_threads()",
        "config.threading.set_intra_op_parallelism_threads(3)", "config.threading.get_intra_op_parallelism_threads()",
        "config.threading.set_intra_op_parallelism_threads(0)", "config.threading.get_intra_op_parallelism_threads()",
    ],
    "threads_bad": [
        "config.threading.set_intra_op_parallelism_threads(-1)", "config.threading.get_intra_op_parallelism_threads()",
        "config.threading.set_inter_op_parallelism_threads('a')",
        "config.threading.set_intra_op_parallelism_threads(2.5)",
    ],
    "after_initialization": [
        "len(config.list_logical_devices())", "config.set_visible_devices([], 'GPU')",
        "config.threading.set_intra_op_parallelism_threads(2)",
        "config.set_logical_device_configuration(cpu(), [config.LogicalDeviceConfiguration()] * 2)",
    ],
}

# Answers that differ from TF's on purpose (docs/config.md): TF fixes devices and threads at their first use
# (RuntimeError: "... cannot be modified after being initialized") where md.config applies a device change to the
# strategies created afterwards and fixes the thread counts only once its host pool has started (at the first host
# collective, not at a device listing); TF lets the CPU be hidden and then fails at its first op (NotFoundError: "No CPU devices are
# available"), md.config refuses at once; TF takes any thread count (-1, 'a', 2.5), md.config a count >= 0.
DIFFERS = {("after_initialization", 2), ("after_initialization", 3), ("hide_cpu", 0), ("hide_cpu", 1),
           ("hide_all", 0), ("hide_all", 1), ("threads_bad", 0), ("threads_bad", 1), ("threads_bad", 2),
           ("threads_bad", 3)}
# Errors whose words are ours ('md.config', not 'tf.config'); their type is still TF's.
OWN_WORDS = {("device_details", 1), ("device_details", 2), ("device_details", 3)}
