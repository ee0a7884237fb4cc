"""Records TensorFlow 2.21's tf.TensorShape and tf.TensorSpec answers for tests/test_tensor_shape.py (never imported
by the tests): the repr of each expression of tests/tensor_shape_cases.py, or the error it raises.

    /path/to/venv-with-tensorflow/bin/python tests/data/record_tf_tensor_shape.py
        (writes tests/data/tf_tensor_shape_reference.json)
"""

from recording import tf, write_reference  # (this folder)
from tensor_shape_cases import EXPRESSIONS  # (the tests folder: recording puts it on the path)


def answer(expression):
    try:
        return {"repr": repr(eval(expression, {"TS": tf.TensorShape, "Spec": tf.TensorSpec}))}
    except Exception as e:  # noqa: BLE001 - TF's error is the recorded answer
        return {"raises": type(e).__name__, "msg": str(e)}


if __name__ == "__main__":
    write_reference("tf_tensor_shape_reference.json", {e: answer(e) for e in EXPRESSIONS}, indent=1)
