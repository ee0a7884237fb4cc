"""Keras 3's Muon: momentum orthogonalised by a Newton-Schulz iteration for 2-D variables, AdamW for the rest.

A variable takes Muon's own step when it is 2-D, not an embedding (``exclude_embeddings``: "embedding" in its
path) and matches none of ``exclude_layers`` (regular expressions searched in its path); every other variable
takes Keras' AdamW step (``adam_*`` arguments, learning rate ``learning_rate * adam_lr_ratio``, decay
``adam_weight_decay``). An md variable's path is its name without the ``:0`` suffix (``"dense/kernel:0"`` stands
for Keras' ``"dense/kernel"``).

The fused step of one device and dtype (:class:`_MuonPlan`), whatever the number of variables:

1. the AdamW-routed variables: one call of the ADAM rule (host kernel, or one GPU launch) with weight decay;
2. the Muon-routed ones: one call of the MUON rule (rules.muon_momentum): the momentum, and the matrix to
   orthogonalise written into a stacking buffer (allocated once per variable set), where the variables of one
   shape lie back to back as an ``(n, rows, cols)`` stack;
3. per distinct shape, Newton-Schulz (rules.newton_schulz) as batched matrix products on that stack, then Keras'
   ``lr_adjust`` (``lr * X * sqrt(max(rows, cols)) * rms_rate``);
4. one call of the SGD rule at learning rate 1 (``w - u * 1`` is ``w - u``) over the Muon-routed variables,
   their gradients the stack, with weight decay: Keras' ``w -= w * weight_decay * lr`` first, then ``w -= u``.

Every replica runs the same operations on the same inputs in the same order, so the copies stay bit-identical.
md.function captures the step (the calls read their scalars from the capture's device buffer); a step whose
scalars the device selects (a LossScaleOptimizer skipping steps on the GPU) is not supported.
"""

from __future__ import annotations

import math
import numbers
import re
import weakref

import numpy as np

from ...device import device_util
from ...device.dtypes import dtype_code
from ...distribute import values
from .base import (_KERNEL_DTYPES, _VALUE, Optimizer, _gate_pointers, _gpu_kernel, _host_grad, _host_kernel, _Plan,
                   _plains, _retire_tables, _retired_tables, check_rate)
from .rules import (ADAM, MUON, SGD, SquaredGradient, apply as apply_rule, array_module, newton_schulz,
                    newton_schulz_host, weight_decay as apply_weight_decay)

__all__ = ["Muon", "variable_step"]

# The positions of Muon's scalars in its coefficients (one flat list per dtype, the layout a device buffer would
# hold): each rule's coefficients followed by its weight decay's rate and learning rate.
_ADAM, _ADAM_DECAY = slice(0, 4), slice(4, 6)
_MOMENTUM = slice(6, 9)
_APPLY, _APPLY_DECAY = slice(9, 10), slice(10, 12)
_LR, _RMS = 11, 12


def _path(var) -> str:
    """Keras' ``variable.path`` of an md variable: its name without the ``:0`` suffix."""
    return re.sub(r":\d+$", "", var.name)


def _number(value, argument: str, low: float = -math.inf, allow_none: bool = False):
    if value is None and allow_none:
        return None
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(value) or value < low:
        bound = "" if low == -math.inf else f" >= {low}"
        raise ValueError(f"{argument}={value!r}: expected a finite number{bound}"
                         + (" or None" if allow_none else ""))
    return value


class Muon(Optimizer):
    """Muon (Jordan et al., 2024; Liu et al., 2025), as ``keras.optimizers.Muon``: 2-D variables take SGD momentum
    (Nesterov by default) orthogonalised by ``ns_steps`` Newton-Schulz steps (``muon_a``, ``muon_b``, ``muon_c``),
    scaled by ``sqrt(max(rows, cols)) * rms_rate``; the others (and embeddings, and ``exclude_layers`` matches)
    take AdamW. Slots: ``momentum`` for every variable, ``velocity`` for the AdamW-routed ones."""

    _config_keys = ("adam_beta_1", "adam_beta_2", "epsilon", "exclude_layers", "muon_a", "muon_b", "muon_c",
                    "adam_lr_ratio", "momentum", "ns_steps", "nesterov", "exclude_embeddings", "adam_weight_decay",
                    "rms_rate")
    _coefficients_use_step = True  # the AdamW step's bias corrections
    _slot_specs = (("momentum", 0.0), ("velocity", 0.0))
    _rule = MUON

    def __init__(self, learning_rate=0.001, adam_beta_1: float = 0.9, adam_beta_2: float = 0.999,
                 adam_weight_decay=0.004, epsilon: float = 1e-7, weight_decay=0.004, clipnorm=None, clipvalue=None,
                 global_clipnorm=None, use_ema=False, ema_momentum=0.99, ema_overwrite_frequency=None,
                 loss_scale_factor=None, gradient_accumulation_steps=None, name: str | None = None,
                 exclude_layers=None, exclude_embeddings: bool = True, muon_a: float = 3.4445,
                 muon_b: float = -4.7750, muon_c: float = 2.0315, adam_lr_ratio=1, momentum: float = 0.95,
                 ns_steps: int = 5, nesterov: bool = True, rms_rate=0.2, gradient_aggregation="sum", **kwargs):
        super().__init__(learning_rate, name, gradient_aggregation, weight_decay=weight_decay, clipnorm=clipnorm,
                         clipvalue=clipvalue, global_clipnorm=global_clipnorm, use_ema=use_ema,
                         ema_momentum=ema_momentum, ema_overwrite_frequency=ema_overwrite_frequency,
                         loss_scale_factor=loss_scale_factor,
                         gradient_accumulation_steps=gradient_accumulation_steps, **kwargs)
        self.adam_beta_1 = check_rate(adam_beta_1, "adam_beta_1", low=0.0, high=1.0)
        self.adam_beta_2 = check_rate(adam_beta_2, "adam_beta_2", low=0.0, high=1.0)
        self.epsilon = check_rate(epsilon, "epsilon")
        self.adam_weight_decay = _number(adam_weight_decay, "adam_weight_decay", 0.0, allow_none=True)
        self.muon_a = _number(muon_a, "muon_a")
        self.muon_b = _number(muon_b, "muon_b")
        self.muon_c = _number(muon_c, "muon_c")
        self.adam_lr_ratio = _number(adam_lr_ratio, "adam_lr_ratio", 0.0)
        self.momentum = check_rate(momentum, "momentum", low=0.0, high=1.0, high_inclusive=True)
        if isinstance(ns_steps, bool) or not isinstance(ns_steps, numbers.Integral) or ns_steps < 0:
            raise ValueError(f"ns_steps={ns_steps!r}: expected an integer >= 0 (the number of Newton-Schulz "
                             "iterations, 5 by default)")
        self.ns_steps = int(ns_steps)
        self.nesterov = bool(nesterov)
        self.exclude_embeddings = bool(exclude_embeddings)
        if isinstance(exclude_layers, str):
            raise ValueError(f"exclude_layers={exclude_layers!r}: expected a list of strings (regular "
                             "expressions searched in the variables' paths), e.g. ['output_dense']")
        self.exclude_layers = list(exclude_layers or [])
        for keyword in self.exclude_layers:
            try:
                re.compile(keyword)
            except (TypeError, re.error) as error:
                raise ValueError(f"exclude_layers: {keyword!r} is not a regular expression ({error})") from None
        self.rms_rate = _number(rms_rate, "rms_rate", 0.0, allow_none=True)

    def _should_use_adamw(self, var) -> bool:
        """Keras' routing: AdamW for a variable that is not 2-D, an embedding, or matched by exclude_layers."""
        if len(var.shape) != 2:
            return True
        path = _path(var)
        if self.exclude_embeddings and "embedding" in path.lower():
            return True
        return any(re.search(keyword, path) for keyword in self.exclude_layers)

    def _var_state_specs(self, var) -> tuple:
        specs = self._state_specs
        return specs if self._should_use_adamw(var) else tuple(s for s in specs if s[0] != "velocity")

    @property
    def _keras_slot_groups(self) -> tuple:
        # Keras builds each variable's momentum and then (AdamW-routed) its velocity, variable after variable.
        return (("momentum", "velocity"),)

    def _new_plan(self, variables) -> "_MuonPlan":
        return _MuonPlan(self, variables)

    def _coefficients(self, t, lr, step):
        """Every scalar of the step in one list (the positions named at the top of this module): AdamW's
        coefficients at ``learning_rate * adam_lr_ratio`` (a float32 product, as Keras') and its decay, Muon's
        momentum coefficients, the final SGD call's (rate 1) and its decay, then ``rms_rate``."""
        local_step = t(step + 1)
        beta_1_power = np.power(t(np.float32(self.adam_beta_1)), local_step)
        beta_2_power = np.power(t(np.float32(self.adam_beta_2)), local_step)
        adam_lr = t(np.float32(lr) * np.float32(self.adam_lr_ratio))
        alpha = adam_lr * np.sqrt(t(1) - beta_2_power) / (t(1) - beta_1_power)

        def decay(rate):  # Keras: ops.cast of the rate (through float32), 0 for None (no variable decays then)
            return t(0) if rate is None else t(np.float32(rate))
        return (t(1 - self.adam_beta_1), t(1 - self.adam_beta_2), alpha, t(self.epsilon),
                decay(self.adam_weight_decay), lr,
                t(self.momentum - 1), t(self.momentum), t(self.nesterov),
                t(1), decay(self.weight_decay), lr,
                t(1 if self.rms_rate is None else self.rms_rate))


class _MuonPlan(_Plan):
    """The plan of a Muon step (see the module's docstring). Each dtype group's variables are ordered AdamW-routed
    first, then the Muon-routed ones by shape (stably), so the packed gradients of each branch are contiguous
    and the variables of a shape are one stack of the stacking buffer."""

    def __init__(self, optimizer: Muon, variables: list):
        super().__init__(optimizer, variables)
        # Keras decides by the velocity's presence, made at build.
        self.adamw = [len(self.slots[0][k]) == 2 for k in range(len(variables))]
        rates = (optimizer.adam_weight_decay, optimizer.weight_decay)
        self.decay = [rates[not self.adamw[k]] is not None and optimizer._use_weight_decay(v)
                      for k, v in enumerate(variables)]
        self.layout = {}  # dtype -> (AdamW indices, Muon indices, AdamW elements, [(start, n, shape)] per shape)
        for dtype, indices in list(self.groups.items()):
            first = [k for k in indices if self.adamw[k]]
            shapes = {}
            for k in indices:
                if not self.adamw[k]:
                    shapes.setdefault(tuple(variables[k].shape), []).append(k)
            muon = [k for ks in shapes.values() for k in ks]
            stacks, at = [], 0
            for shape, ks in shapes.items():
                stacks.append((at, len(ks), shape))
                at += len(ks) * shape[0] * shape[1]
            self.groups[dtype] = first + muon
            self.layout[dtype] = (first, muon, sum(self.copies[0][k]._value.size for k in first), stacks)
        self.in_order = all(indices == sorted(indices) for indices in self.groups.values())
        self.stacks = [None] * self.num_devices  # per device: {dtype: stacking buffer}, made by its first step
        self.stack_views = {}  # (device, dtype) -> each Muon-routed variable's view of the stacking buffer (host)
        self.muon_tables = [None] * self.num_devices  # per device: {dtype: (ADAM, MUON, SGD tables or None)}

    def prepare_rows(self, lower: int, upper: int) -> None:
        raise NotImplementedError(
            "Muon under a LossScaleOptimizer whose GPU steps may be skipped on the device: its scalars follow the "
            "step, which only the device knows; use dynamic=False, or CPU replicas")

    def _stack(self, device: int, dtype):
        """Device ``device``'s stacking buffer of ``dtype`` (every Muon-routed variable's elements, stacked by
        shape), allocated once."""
        stacks = self.stacks[device]
        if stacks is None:
            stacks = self.stacks[device] = {}
        buffer = stacks.get(dtype)
        if buffer is None:
            _, muon, _, _ = self.layout[dtype]
            size = sum(self.copies[device][k]._value.size for k in muon)
            buffer = stacks[dtype] = device_util.empty(size, dtype, self.copies[device][0].device)
        return buffer

    def _orthogonalised(self, stack, dtype, c) -> None:
        """Newton-Schulz on each shape's stack of ``stack``, in place, then Keras' lr_adjust:
        ``((lr * X) * sqrt(max(rows, cols))) * rms_rate`` (no factors without rms_rate)."""
        opt = self.optimizer
        t = np.dtype(dtype).type
        host = isinstance(stack, np.ndarray)
        for start, n, (rows, cols) in self.layout[dtype][3]:
            view = stack[start:start + n * rows * cols].reshape(n, rows, cols)
            if host:  # (in place, chunk by chunk, the scaling with each chunk: the same values, see rules)
                scales = (c[_LR],) if opt.rms_rate is None else \
                    (c[_LR], t(np.sqrt(np.float32(max(rows, cols)))), c[_RMS])
                newton_schulz_host(view, opt.ns_steps, opt.muon_a, opt.muon_b, opt.muon_c, scales)
                continue
            x = newton_schulz(view, opt.ns_steps, opt.muon_a, opt.muon_b, opt.muon_c)
            array_module(view).multiply(x, c[_LR], out=view)
            if opt.rms_rate is not None:
                view *= t(np.sqrt(np.float32(max(rows, cols))))  # (Keras: a float32 sqrt of the larger dim)
                view *= c[_RMS]

    # -- host --
    def _apply_host(self, device: int, grads, packed, summands=None) -> None:
        self._writable(device)
        weights = list(map(_VALUE, self.copies[device]))
        ready = None if grads is None else self.host_grads(_plains(grads))
        rest = {}
        for j, (dtype, indices) in enumerate(self.groups.items()):
            if dtype not in _KERNEL_DTYPES:
                rest[dtype] = indices
                continue
            first, muon, split, _ = self.layout[dtype]
            c = [float(x) for x in self.coefficients[dtype]]

            def subset(ks, part):
                """The gradients of variables ``ks`` (``part``: their slice of a packed buffer)."""
                if packed is not None:
                    return packed[j][part]
                if summands is not None:
                    return tuple([replica[k] for k in ks] for replica in summands)
                return [ready[k] for k in ks]

            if first:
                squares = () if grads is None or SquaredGradient not in map(type, grads) else \
                    ([_host_grad(grads[k].squares, dtype) if type(grads[k]) is SquaredGradient else None
                      for k in first],)
                _host_kernel(ADAM, [weights[k] for k in first], subset(first, slice(0, split)),
                             [list(map(_VALUE, self.slots[device][k])) for k in first],
                             [self.decay[k] for k in first], c[_ADAM], *c[_ADAM_DECAY], *squares)
            if muon:
                stack = self._stack(device, dtype)
                views = self._stack_views(device, dtype, stack)
                _host_kernel(MUON, views, subset(muon, slice(split, None)),
                             [[self.slots[device][k][0]._value] for k in muon], [False] * len(muon), c[_MOMENTUM],
                             0.0, 0.0)
                self._orthogonalised(stack, dtype, self.coefficients[dtype])
                _host_kernel(SGD, [weights[k] for k in muon], stack, [[] for _ in muon],
                             [self.decay[k] for k in muon], c[_APPLY], *c[_APPLY_DECAY])
        if rest:
            self._apply_each(device, grads, rest)

    def _stack_views(self, device: int, dtype, stack) -> list:
        """Per Muon-routed variable of ``dtype``, its place in the stacking buffer (the MUON rule's "weights")."""
        views = self.stack_views.get((device, dtype))
        if views is None:
            views, at = [], 0
            for k in self.layout[dtype][1]:
                size = self.copies[device][k]._value.size
                views.append(stack[at:at + size])
                at += size
            self.stack_views[(device, dtype)] = views
        return views

    # -- GPU --
    def _muon_tables(self, device: int) -> dict:
        """Device ``device``'s tables per dtype: (ADAM over the AdamW-routed variables, MUON over the stacking
        buffer with the Muon-routed variables' momentums, SGD over the Muon-routed variables), None where a
        branch has no variable; made once (again only after a copy-on-write)."""
        module = _gpu_kernel()
        ordinal = device_util.physical_ordinal(self.copies[device][0].device)
        tables = {}
        for dtype, (first, muon, _, _) in self.layout.items():
            code = dtype_code(dtype)
            weights = [self.copies[device][k]._value for k in self.groups[dtype]]
            by_index = dict(zip(self.groups[dtype], weights))
            adam_table = muon_table = sgd_table = None
            if first:
                adam_table = module.FusedUpdateTable(
                    ordinal, code, [by_index[k].data.ptr for k in first],
                    [[s._value.data.ptr for s in self.slots[device][k]] for k in first],
                    [by_index[k].size for k in first], [self.decay[k] for k in first])
            if muon:
                stack = self._stack(device, dtype)
                sizes = [by_index[k].size for k in muon]
                at, pointers = stack.data.ptr, []
                for size in sizes:
                    pointers.append(at)
                    at += size * stack.itemsize
                muon_table = module.FusedUpdateTable(
                    ordinal, code, pointers, [[self.slots[device][k][0]._value.data.ptr] for k in muon], sizes,
                    [False] * len(muon))
                sgd_table = module.FusedUpdateTable(ordinal, code, [by_index[k].data.ptr for k in muon],
                                                    [[] for _ in muon], sizes, [self.decay[k] for k in muon])
            tables[dtype] = (adam_table, muon_table, sgd_table)
        return tables

    def _apply_gpu(self, device: int, grads, packed, gate=None) -> None:
        """Per dtype: one launch for the AdamW-routed variables, one for the Muon momentum into the stacking
        buffer, Newton-Schulz's batched products per distinct shape, one launch for the Muon-routed variables."""
        self._writable(device)
        _retired_tables.clear()
        if self.tables_made_at[device] != values.buffers_replaced:
            self.muon_tables[device] = self._muon_tables(device)
            self.tables_made_at[device] = values.buffers_replaced
        packed, squares, stream = self._step_inputs(device, grads, packed)
        nonfinite, scale = _gate_pointers(gate)
        if gate is not None and gate.dynamic:  # (every dtype's gradients checked before any update reads the flag)
            for buffer, (dtype, (_, _, split, _)) in zip(packed, self.layout.items()):
                adam_table, muon_table, _ = self.muon_tables[device][dtype]
                for table, at in ((adam_table, 0), (muon_table, split)):
                    if table is not None:
                        table.check_finite(buffer.data.ptr + at * buffer.itemsize, gate.nonfinite, stream)
        for buffer, (dtype, (_, _, split, _)), square in zip(packed, self.layout.items(), squares):
            adam_table, muon_table, sgd_table = self.muon_tables[device][dtype]
            c = [float(x) for x in self.coefficients[dtype]]
            grad = buffer.data.ptr
            if adam_table is not None:
                adam_table.apply(ADAM, grad, c[_ADAM], *c[_ADAM_DECAY], stream, nonfinite, scale, squares=square)
            if muon_table is not None:
                stack = self._stack(device, dtype)
                muon_table.apply(MUON, grad + split * buffer.itemsize, c[_MOMENTUM], 0.0, 0.0, stream, nonfinite,
                                 scale)
                self._orthogonalised(stack, dtype, self.coefficients[dtype])
                # (the stack is no gradient: not divided by the loss scale; a skipped step skips this too)
                sgd_table.apply(SGD, stack.data.ptr, c[_APPLY], *c[_APPLY_DECAY], stream, nonfinite, 0)

    def capture_scalars(self, scope, step: int, selected: bool = False) -> dict:
        if selected:
            self.prepare_rows(step, step)  # (raises: the device cannot pick Muon's scalars)
        return super().capture_scalars(scope, step, selected)

    def _apply_gpu_captured(self, device: int, grads, packed, scope, gate=None) -> None:
        """``_apply_gpu`` recorded into the step's graph: tables of the capture's own, each call reading its
        scalars from the capture's buffer of its dtype at its rule's place (coefficients, then decay's rate and
        lr: the layout of ``Muon._coefficients``), Newton-Schulz's scale from 0-d views of it."""
        for c in self.written[device]:
            c._writable_buffer()  # the graph writes these buffers: md.function checks they stay
        packed, squares, stream = self._step_inputs(device, grads, packed)
        tables = self._muon_tables(device)
        kept = [t for parts in tables.values() for t in parts if t is not None]
        scope.captured.setdefault("fused update tables", []).append(kept)
        weakref.finalize(scope, _retire_tables, kept)
        nonfinite, scale = _gate_pointers(gate)
        if gate is not None and gate.dynamic:
            for buffer, (dtype, (_, _, split, _)) in zip(packed, self.layout.items()):
                for table, at in zip(tables[dtype][:2], (0, split)):
                    if table is not None:
                        table.check_finite(buffer.data.ptr + at * buffer.itemsize, gate.nonfinite, stream)
        for buffer, (dtype, (_, _, split, _)), square in zip(packed, self.layout.items(), squares):
            adam_table, muon_table, sgd_table = tables[dtype]
            captured = scope.captured[self][device][dtype]
            scalars, size = captured.buffer.data.ptr, captured.buffer.itemsize
            if adam_table is not None:
                adam_table.apply_captured(ADAM, buffer.data.ptr, scalars + _ADAM.start * size, 4, stream, nonfinite,
                                          scale, squares=square)
            if muon_table is not None:
                stack = self._stack(device, dtype)
                muon_table.apply_captured(MUON, buffer.data.ptr + split * buffer.itemsize,
                                          scalars + _MOMENTUM.start * size, 3, stream, nonfinite, scale)
                self._orthogonalised(stack, dtype, captured.coefficients)
                sgd_table.apply_captured(SGD, stack.data.ptr, scalars + _APPLY.start * size, 1, stream, nonfinite,
                                         0)

    # -- array operations (float16, bfloat16; GPU arrays without the CUDA kernel) --
    def _apply_each(self, device: int, grads, groups: dict) -> None:
        """Keras' two steps variable by variable, as array operations in the variable's dtype."""
        weights = [c._writable_buffer() for c in self.copies[device]]
        slots = [[s._writable_buffer() for s in slots] for slots in self.slots[device]]
        for dtype, indices in groups.items():
            for k in indices:
                g = grads[k]
                if type(g) is not SquaredGradient and g.dtype != dtype:
                    g = g.astype(dtype)
                variable_step(self.optimizer, weights[k], g, slots[k], self.coefficients[dtype], self.adamw[k],
                              self.decay[k])


def variable_step(opt: Muon, w, g, slots, c, adamw: bool, decay: bool) -> None:
    """One variable's Muon step as array operations in w's dtype (``c``: ``opt._coefficients``'): Keras' AdamW
    step (``adamw``, slots momentum and velocity) or its Muon step (slot momentum), weight decay first
    (``decay``). The fused step's reference, one variable at a time."""
    if adamw:
        if decay:
            apply_weight_decay(w, *c[_ADAM_DECAY])
        apply_rule(ADAM, w, g, slots, c[_ADAM])
        return
    x = array_module(w).empty_like(w)
    apply_rule(MUON, x, g, slots, c[_MOMENTUM])
    stack = x.reshape(1, *w.shape)
    stack[...] = newton_schulz(stack, opt.ns_steps, opt.muon_a, opt.muon_b, opt.muon_c)
    x *= c[_LR]
    if opt.rms_rate is not None:
        x *= w.dtype.type(np.sqrt(np.float32(max(w.shape))))
        x *= c[_RMS]
    if decay:
        apply_weight_decay(w, *c[_APPLY_DECAY])
    w -= x
