"""``md.function``'s ``input_signature`` and its trace types: tf.function's rules for what a call may pass.

With an ``input_signature`` (a list or tuple of ``md.TensorSpec``, nested in tuples, lists and dicts) every call
binds its arguments to the Python function's parameters as TF does, converts each argument that a spec covers
to the spec's dtype (``md.convert_to_tensor``'s rules: NumPy arrays cast, Python values convert where TF
converts them, tensors keep their dtype) and checks its shape (``None`` dimensions take any size, a spec of
unknown rank any shape). A call that does not fit raises TF's ``TypeError``. The function traces once.

Without a signature, a call traces again when no earlier trace's type covers its own (TF's trace types: arrays
by shape and dtype, other values by value); with ``reduce_retracing`` a new trace takes the most general type
its arrays share with the earlier traces (dimensions that differ become ``None``; ranks that differ, any rank).
"""

from __future__ import annotations

import inspect
import weakref

import numpy as np

from .._nest import flatten, flatten_with_structure_key
from ..data.structure import TensorSpec
from ..device import device_util
from ..device.indexed_slices import convert_to_tensor, is_indexed_slices
from .values import DistributedValues, Variable


def validate(python_function, input_signature):
    """The signature as a tuple, with the Python function's parameters it binds; TF's TypeError otherwise."""
    if input_signature is None:
        return None
    if not isinstance(input_signature, (tuple, list)):
        raise TypeError(f"input_signature must be either a tuple or a list, got {type(input_signature)}. (pass "
                        "a list of md.TensorSpec, one per positional parameter, e.g. [md.TensorSpec([None], "
                        "'float32')])")
    invalid = [leaf for leaf in flatten(list(input_signature)) if not isinstance(leaf, TensorSpec)]
    if invalid:
        raise TypeError(f"input_signature must be a possibly nested sequence of TensorSpec objects, got invalid "
                        f"args {invalid} with types {[type(x) for x in invalid]}. (describe each argument with "
                        "md.TensorSpec(shape, dtype))")
    parameters = list(inspect.signature(python_function).parameters.values())
    positional = _constrained(parameters)
    takes_more = any(p.kind == p.VAR_POSITIONAL for p in parameters)
    if len(input_signature) > len(positional) and not takes_more:
        raise TypeError(f"input_signature contains {len(input_signature) - len(positional)} extra type "
                        f"constraints. ({python_function.__name__} takes {len(positional)} positional "
                        "arguments: give one spec for each)")
    for p in parameters:
        if p.kind == p.KEYWORD_ONLY and p.default is p.empty:
            raise TypeError(f"Since input_signature is defined, keyword-only parameter `{p.name}` must have a "
                            "default value (give it one, or make it positional and add a spec for it)")
    for p in positional[len(input_signature):]:
        if p.default is p.empty:
            raise TypeError(f"input_signature missing type constraint for {p.name} (add a spec for it, or give "
                            "it a default value)")
    return tuple(input_signature)


def _constrained(parameters) -> list:
    """The parameters an input_signature's specs go to, in order: the positional ones but ``self`` (TF leaves
    a method's instance unconstrained)."""
    return [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "self"]


class Binder:
    """Binds a call's arguments to a signature: converted, checked, in TF's words when they do not fit."""

    def __init__(self, python_function, input_signature: tuple):
        parameters = list(inspect.signature(python_function).parameters.values())
        self._signature = inspect.Signature(parameters)
        self._specs = {}  # parameter name -> its spec (a TensorSpec or a structure of them)
        positional = _constrained(parameters)
        for p, spec in zip(positional, input_signature):
            self._specs[p.name] = spec
        self._var_specs = input_signature[len(positional):]
        self._unconstrained = positional[len(input_signature):]  # (each has a default: validate checked it)
        self._keyword_only = [p for p in parameters if p.kind == p.KEYWORD_ONLY]
        self._var_name = next((p.name for p in parameters if p.kind == p.VAR_POSITIONAL), None)
        described = [f"{p.name}: {self._specs[p.name]!r}" if p.name in self._specs else str(p) for p in parameters]
        self.description = f"({', '.join(described)})"

    def bind(self, args, kwargs):
        """``(args, kwargs)`` converted to the signature, or TF's TypeError."""
        try:
            bound = self._signature.bind(*args, **kwargs)
            for name, spec in self._specs.items():
                if name in bound.arguments:
                    bound.arguments[name] = _fit(bound.arguments[name], spec)
            if self._var_name is not None and self._var_specs:
                extra = bound.arguments.get(self._var_name, ())
                bound.arguments[self._var_name] = tuple(
                    _fit(v, s) for v, s in zip(extra, self._var_specs)) + tuple(extra[len(self._var_specs):])
            for p in self._unconstrained + self._keyword_only:  # (TF fixes them to their defaults)
                if p.name in bound.arguments:
                    _fit(bound.arguments[p.name], Literal(p.default))
        except (TypeError, ValueError) as e:
            raise TypeError(f"Binding inputs to tf.function failed due to `{e}`. Received args: {args!r} and "
                            f"kwargs: {kwargs!r} for signature: {self.description}. (md.function's "
                            "input_signature: pass arguments of the specs' structure, dtypes that convert to theirs "
                            "and shapes that fit theirs)") from None
        return bound.args, bound.kwargs

    def example(self):
        """The arguments of the signature's concrete function: the specs, then the Python function's defaults of the
        parameters they leave out (TF traces those as values the concrete function's calls must repeat)."""
        positional = list(self._specs.values()) + list(self._var_specs)
        positional += [p.default for p in self._unconstrained]
        return positional, {p.name: p.default for p in self._keyword_only}


class Literal:
    """A Python value a concrete function was traced with: its calls must pass an equal one (TF's Literal)."""

    def __init__(self, value):
        self.value = value

    def __repr__(self):
        return f"Literal[{self.value!r}]"


class ConcreteBinder:
    """Binds the calls of a concrete function traced without an input_signature, as TF's: every parameter it
    was traced with is required (defaults included), arrays fit the example's shape and dtype, Python values
    must equal the example's."""

    def __init__(self, python_function, args, kwargs):
        parameters = list(inspect.signature(python_function).parameters.values())
        named, keyword = [], {}
        plain = [p for p in parameters if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
        var = next((p for p in parameters if p.kind == p.VAR_POSITIONAL), None)
        for p, value in zip(plain, args):
            named.append((p.replace(default=p.empty), _example_spec(value)))
        kind = inspect.Parameter.POSITIONAL_ONLY if var is not None else None
        if var is not None:  # (the extra positional arguments, each a positional parameter of the trace)
            named = [(p.replace(kind=kind), spec) for p, spec in named]
            for i, value in enumerate(args[len(plain):]):
                name = f"{var.name}_{i}"
                named.append((inspect.Parameter(name, kind), _example_spec(value)))
        for name, value in kwargs.items():
            keyword[name] = _example_spec(value)
        keyword_parameters = [inspect.Parameter(name, inspect.Parameter.KEYWORD_ONLY) for name in keyword]
        self._signature = inspect.Signature([p for p, _ in named] + keyword_parameters)
        self._positional = [spec for _, spec in named]
        self._keyword = keyword
        described = [f"{p.name}: {spec!r}" for p, spec in named] + [f"{k}: {v!r}" for k, v in keyword.items()]
        self.description = f"({', '.join(described)})"

    def bind(self, args, kwargs):
        try:
            bound = self._signature.bind(*args, **kwargs)
            values = list(bound.arguments.values())
            fitted = [_fit(v, s) for v, s in zip(values, self._positional)]
            keyword = {k: _fit(bound.arguments[k], s) for k, s in self._keyword.items()}
        except (TypeError, ValueError) as e:
            raise TypeError(f"Binding inputs to tf.function failed due to `{e}`. Received args: {args!r} and "
                            f"kwargs: {kwargs!r} for signature: {self.description}. (a concrete function takes "
                            "every argument it was traced with: arrays of its shapes and dtypes, equal Python "
                            "values)") from None
        return tuple(fitted), keyword

    def structured(self):
        names = list(self._signature.parameters)
        return tuple(_named(s, n) for s, n in zip(self._positional, names)), {
            k: _named(v, k) for k, v in self._keyword.items()}

    def concrete_inputs(self) -> list:
        return [s for s in flatten(self.structured()) if isinstance(s, TensorSpec)]


def _example_spec(value):
    """An example argument of get_concrete_function as TF traces it: specs (named after their place) for arrays
    and specs, the same containers around them, Python values as Literals."""
    if isinstance(value, TensorSpec):
        return TensorSpec(value.shape, value.dtype)
    if isinstance(value, (np.ndarray, np.generic, Variable)) or device_util.on_gpu(value):
        return TensorSpec(tuple(value.shape), value.dtype)
    if isinstance(value, dict):
        return {k: _example_spec(v) for k, v in value.items()}
    if isinstance(value, (tuple, list)) and not hasattr(value, "_fields"):
        return type(value)(map(_example_spec, value))
    return Literal(value)


def _named(spec, name):
    """``spec``'s structure, each TensorSpec named after its parameter and place (x, x_0, x_1_a), as TF names,
    and each Literal the value it stands for."""
    if isinstance(spec, TensorSpec):
        return TensorSpec(spec.shape, spec.dtype, name)
    if isinstance(spec, Literal):
        return spec.value
    if isinstance(spec, dict):
        return {k: _named(s, f"{name}_{k}") for k, s in spec.items()}
    return type(spec)(_named(s, f"{name}_{i}") for i, s in enumerate(spec))


def canonical_binder(python_function):
    """``bind(args, kwargs)``: a call's arguments bound to ``python_function``'s parameters, defaults filled in
    (TF's canonical form: positional where a parameter takes them), or TF's TypeError; the identity for a callable
    whose parameters Python cannot tell."""
    try:
        signature = inspect.signature(python_function)
    except (TypeError, ValueError):
        return lambda args, kwargs: (args, kwargs)
    kinds = [p.kind for p in signature.parameters.values()]
    plain = len(kinds) if all(k in (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
                              for k in kinds) else -1

    def bind(args, kwargs):
        if not kwargs and len(args) == plain:  # (already canonical: the step's usual call, bound for nothing)
            return tuple(args), {}
        try:
            bound = signature.bind(*args, **kwargs)
        except TypeError as e:
            raise TypeError(f"Binding inputs to tf.function failed due to `{e}`. Received args: {args!r} and "
                            f"kwargs: {kwargs!r} for signature: {signature}. (pass the arguments "
                            f"{getattr(python_function, '__name__', 'the function')} takes)") from None
        bound.apply_defaults()
        return bound.args, bound.kwargs

    return bind


def _fit(value, spec):
    """``value`` fitted to ``spec``: structures matched, leaves converted and their shapes checked."""
    if isinstance(spec, TensorSpec):
        return _fit_leaf(value, spec)
    if isinstance(spec, Literal):  # (an array compared to it raises numpy's "truth value ... ambiguous", as TF's)
        if not bool(value == spec.value):
            raise TypeError(f"Can not cast {value!r} to {spec!r}")
        return value
    if isinstance(spec, dict):
        if not isinstance(value, dict) or set(value) != set(spec):
            raise TypeError(f"{value!r} has different keys with the TraceType {spec!r}.")
        return {k: _fit(value[k], spec[k]) for k in value}
    kind = type(spec).__name__
    if not isinstance(value, type(spec)):
        raise TypeError(f"Can not cast {value!r} to {kind} type.")
    if len(value) != len(spec):
        raise TypeError(f"Expected {value!r} to have length of {len(spec)}")
    fitted = [_fit(v, s) for v, s in zip(value, spec)]
    return type(value)(*fitted) if hasattr(value, "_fields") else type(value)(fitted)


def _fit_leaf(value, spec: TensorSpec):
    if isinstance(value, DistributedValues) and not isinstance(value, Variable):  # each replica's component
        return type(value)([_fit_leaf(c, spec) for c in value.values], value._devices)
    is_tensor = device_util.on_gpu(value) or isinstance(value, Variable) or is_indexed_slices(value)
    tensor = value if is_tensor else convert_to_tensor(value, dtype=spec.dtype)
    got = TensorSpec(tuple(tensor.shape), tensor.dtype)
    if got.dtype != spec.dtype or not spec.shape.is_compatible_with(got.shape):
        raise TypeError(f"Can not cast {got!r} to {spec!r}")
    return tensor


# --- trace types ------------------------------------------------------------------------
# A call's trace type is (its structure, a type per leaf), hashable: an array is ("tensor", shape, dtype) with
# None for a dimension of any size (the shape None for any rank), any other leaf a literal. Plain tuples, not
# TensorSpecs, so that a call's type costs little: every call of an md.function computes it.

def trace_type(args, kwargs):
    """A call's TF trace type: its structure, arrays by shape and dtype, other leaves as they are."""
    leaves, key = flatten_with_structure_key((tuple(args), dict(kwargs or {})))
    return key, tuple(map(_leaf_type, leaves))


def _leaf_type(leaf):
    if isinstance(leaf, TensorSpec):  # (get_concrete_function's example of an argument)
        return ("tensor", None if leaf.shape.rank is None else tuple(leaf.shape), leaf.dtype)
    if isinstance(leaf, Variable):
        return ("variable", id(leaf))
    if isinstance(leaf, DistributedValues):
        return (type(leaf).__name__, tuple(_leaf_type(c) for c in leaf.values))
    if isinstance(leaf, (np.ndarray, np.generic)) or device_util.on_gpu(leaf):  # (TF converts NumPy scalars too)
        return ("tensor", tuple(leaf.shape), leaf.dtype)
    if leaf is None or isinstance(leaf, (bool, int, float, complex, str, bytes)):
        # By value and equality, as TF's literals: 1, 1.0 and True are one trace type.
        return ("value", leaf)
    try:
        weakref.ref(leaf)
    except TypeError:  # (what TF cannot reference weakly it keys by value, when hashable)
        try:
            hash(leaf)
        except TypeError:
            return ("object", id(leaf))
        return ("value", leaf)
    return ("object", id(leaf))  # any other object by identity, as TF's weak references


def _is_tensor(t) -> bool:
    return type(t) is tuple and len(t) == 3 and t[0] == "tensor"


def _shape_covers(general, specific) -> bool:
    if general is None:
        return True
    return specific is not None and len(general) == len(specific) and all(
        g is None or g == s for g, s in zip(general, specific))


def covers(general, specific) -> bool:
    """Whether every call of trace type ``specific`` fits the trace of type ``general``."""
    return general[0] == specific[0] and all(
        g[2] == s[2] and _shape_covers(g[1], s[1]) if _is_tensor(g) and _is_tensor(s) else g == s
        for g, s in zip(general[1], specific[1]))


def relaxed(target, traced) -> tuple:
    """``target`` generalised over the earlier traces it shares a type with (TF's reduce_retracing): each
    common supertype in turn, in the order they were traced."""
    for other in traced:
        common = _common(target, other)
        if common is not None:
            target = common
    return target


def _common(a, b):
    """The most specific type both fit (dimensions that differ: None; ranks that differ: any rank), or None."""
    if a[0] != b[0]:
        return None
    leaves = []
    for x, y in zip(a[1], b[1]):
        if _is_tensor(x) and _is_tensor(y):
            if x[2] != y[2]:
                return None
            if x[1] is None or y[1] is None or len(x[1]) != len(y[1]):
                leaves.append(("tensor", None, x[2]))
            else:
                leaves.append(("tensor", tuple(p if p == q else None for p, q in zip(x[1], y[1])), x[2]))
        elif x == y:
            leaves.append(x)
        else:
            return None
    return a[0], tuple(leaves)
