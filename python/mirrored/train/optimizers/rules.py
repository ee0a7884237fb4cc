"""The update rules of Keras 3's optimizers, applied in place to one device's arrays.

Each rule is the exact sequence of element-wise operations that Keras' ``update_step``
runs under TensorFlow, in the variable's dtype, each rounded on its own (no fused
multiply-add): the same sequence is the fused host kernel's (``csrc/host/fused_update.cc``),
so both give bit-identical results and match Keras to the last bit where the
scalars (computed by each optimizer's ``_coefficients``) match.

``apply(rule, w, g, slots, c)`` updates ``w`` and ``slots`` (arrays of one dtype, NumPy or
CuPy) with the gradient ``g`` and the coefficients ``c`` (scalars of that dtype). It is the
reference of the kernel, and the update for arrays the kernel does not take (float16,
bfloat16, GPU arrays without the CUDA kernel).
"""

from __future__ import annotations

import math
import sys
from typing import NamedTuple

import numpy as np

# Rule codes shared with csrc/core/optimizer_rules.h (enum class Rule). RMSprop's variants
# (momentum, centered) are read from its coefficients, by the kernel as by rmsprop() below.
# EMA is Keras' moving average of the variables (use_ema): its "weight" is the average and
# its "gradient" the variable.
(SGD, SGD_MOMENTUM, SGD_NESTEROV, ADAM, RMSPROP, ADAGRAD, NADAM, ADAM_AMSGRAD, EMA, ADAMAX, ADADELTA, LION,
 FTRL) = range(13)
# Rules that reduce over a whole variable (Lamb's norms, Adafactor's row and column means): their kernels
# (csrc/core/lamb.h, csrc/core/adafactor_rule.h) walk whole tables in a few phases, every sum in one order
# (variable_sum's; a mean's in index order). A rule in PER_VARIABLE would run variable by variable as array
# operations (NumPy on host, CuPy on a GPU), as every rule does for dtypes no kernel takes; none does now.
LAMB, ADAFACTOR = 13, 14
PER_VARIABLE = frozenset()
# Element-wise again (after the whole-variable rules, whose codes stay).
SCHEDULE_FREE_ADAMW = 15
# Muon's element-wise part (muon_momentum): its momentum and the matrix Newton-Schulz takes. The rest of Muon's
# step is matrix products on stacks of same-shaped matrices (newton_schulz) and the ADAM and SGD rules
# (python/mirrored/train/optimizers/muon.py).
MUON = 16

# The positions of the coefficients a rule branches on in Python (RMSprop's momentum and
# centered, Ftrl's power: 0.5 is a square root): a captured step (md.function) keeps them as
# host values, fixed at capture, and reads every other coefficient from device memory,
# refreshed before each replay.
HOST_COEFFICIENTS = {RMSPROP: (4, 5), FTRL: (1,)}


class SquaredGradient(NamedTuple):
    """A gradient with the squares a rule takes in place of ``g * g``: an IndexedSlices gradient densified
    (``grad``) and its rows squared, then added up (``squares``). Keras' TF backend squares IndexedSlices row
    by row, so a row that two slices (or two replicas) name adds their squares, not the square of their sum."""

    grad: object
    squares: object


# The rules that square the gradient (the others take a SquaredGradient's plain ``grad``).
# (Muon: its AdamW-routed variables square their gradients; its own rule reads the plain gradient.)
SQUARING = frozenset((ADAM, RMSPROP, ADAGRAD, NADAM, ADAM_AMSGRAD, ADADELTA, FTRL, LAMB, ADAFACTOR,
                      SCHEDULE_FREE_ADAMW, MUON))


def _split(g) -> tuple:
    """``(g, its squares)``: a SquaredGradient's, else ``g * g`` (a new array either way)."""
    if type(g) is SquaredGradient:
        return g.grad, g.squares.copy()
    return g, g * g


def weight_decay(w, wd, lr) -> None:
    """Keras' decoupled weight decay, ``w -= w * wd * lr``, before the update."""
    t = w * wd
    t *= lr
    w -= t


def sgd(w, g, slots, c) -> None:
    (lr,) = c
    w -= g * lr


def sgd_momentum(w, g, slots, c) -> None:
    lr, mu = c
    (m,) = slots
    m *= mu
    m -= g * lr
    w += m


def sgd_nesterov(w, g, slots, c) -> None:
    lr, mu = c
    (m,) = slots
    m *= mu
    m -= g * lr
    t = m * mu
    t -= g * lr
    w += t


def _moments(g, squares, m, v, one_minus_beta_1, one_minus_beta_2) -> None:
    """Adam's and Nadam's moment updates: ``m += (g - m) * (1 - beta_1)``, ``v += (g*g - v) * (1 - beta_2)``
    (``squares``: g*g, a new array)."""
    t = g - m
    t *= one_minus_beta_1
    m += t
    t = squares
    t -= v
    t *= one_minus_beta_2
    v += t


def _adam_step(w, m, v, alpha, epsilon) -> None:
    """``w -= (m * alpha) / (sqrt(v) + epsilon)``."""
    d = _sqrt(v)
    d += epsilon
    t = m * alpha
    t /= d
    w -= t


def adam(w, g, slots, c) -> None:
    one_minus_beta_1, one_minus_beta_2, alpha, epsilon = c
    m, v = slots
    _moments(*_split(g), m, v, one_minus_beta_1, one_minus_beta_2)
    _adam_step(w, m, v, alpha, epsilon)


def adam_amsgrad(w, g, slots, c) -> None:
    """Adam with amsgrad: ``velocity_hat = maximum(velocity_hat, velocity)`` (a NaN on either side
    propagates, as in tf.maximum), and the step divides by its square root."""
    one_minus_beta_1, one_minus_beta_2, alpha, epsilon = c
    m, v, v_hat = slots
    _moments(*_split(g), m, v, one_minus_beta_1, one_minus_beta_2)
    array_module(v_hat).maximum(v_hat, v, out=v_hat)
    _adam_step(w, m, v_hat, alpha, epsilon)


def ema(average, w, slots, c) -> None:
    """Keras' moving average: ``average = momentum * average + (1 - momentum) * w``."""
    momentum, one_minus_momentum = c
    average *= momentum
    average += w * one_minus_momentum


def rmsprop(w, g, slots, c) -> None:
    """``slots``: velocity, then average_gradient when centered, then momentum when momentum > 0."""
    lr, rho, one_minus_rho, epsilon, momentum, centered = c
    g, squares = _split(g)
    v = slots[0]
    v *= rho
    squares *= one_minus_rho
    v += squares
    if centered:
        a = slots[1]
        a *= rho
        a += g * one_minus_rho
        d = v - a * a
        d += epsilon
    else:
        d = v + epsilon
    t = g * lr
    t /= _sqrt(d)
    if momentum:
        mom = slots[-1]
        mom *= momentum
        mom += t
        w -= mom
    else:
        w -= t


def adagrad(w, g, slots, c) -> None:
    lr, epsilon = c
    (acc,) = slots
    g, squares = _split(g)
    acc += squares
    t = g * lr
    t /= _sqrt(acc + epsilon)
    w -= t


def nadam(w, g, slots, c) -> None:
    (lr, epsilon, one_minus_beta_1, one_minus_beta_2, u_t_1, one_minus_u_product_t_1, one_minus_u_t,
     one_minus_u_product_t, one_minus_beta_2_power) = c
    m, v = slots
    g, squares = _split(g)
    _moments(g, squares, m, v, one_minus_beta_1, one_minus_beta_2)
    m_hat = m * u_t_1
    m_hat /= one_minus_u_product_t_1
    t = g * one_minus_u_t
    t /= one_minus_u_product_t
    m_hat += t
    d = v / one_minus_beta_2_power
    d = _sqrt(d)
    d += epsilon
    m_hat *= lr
    m_hat /= d
    w -= m_hat


def adamax(w, g, slots, c) -> None:
    """``m += (g - m) * (1 - beta_1)``, ``u = maximum(beta_2 * u, |g|)`` (a NaN propagates, as tf.maximum),
    ``w -= (lr * m) / ((1 - beta_1^t) * (u + epsilon))``."""
    one_minus_beta_1, beta_2, lr, one_minus_beta_1_power, epsilon = c
    m, u = slots
    t = g - m
    t *= one_minus_beta_1
    m += t
    xp = array_module(u)
    u *= beta_2
    xp.maximum(u, xp.abs(g), out=u)
    t = m * lr
    d = u + epsilon
    d *= one_minus_beta_1_power
    t /= d
    w -= t


def adadelta(w, g, slots, c) -> None:
    """``accumulated_grad = rho * accumulated_grad + (1 - rho) * g*g``, the step
    ``delta = -(sqrt(accumulated_delta_var + epsilon) * g) / sqrt(accumulated_grad + epsilon)``,
    ``accumulated_delta_var = rho * accumulated_delta_var + (1 - rho) * delta*delta``, ``w += lr * delta``."""
    lr, rho, one_minus_rho, epsilon = c
    accumulated_grad, accumulated_delta = slots
    g, squares = _split(g)
    accumulated_grad *= rho
    squares *= one_minus_rho
    accumulated_grad += squares
    delta = _sqrt(accumulated_delta + epsilon)
    delta *= g
    delta /= _sqrt(accumulated_grad + epsilon)
    delta = -delta
    accumulated_delta *= rho
    t = delta * delta
    t *= one_minus_rho
    accumulated_delta += t
    delta *= lr
    w += delta


def lion(w, g, slots, c) -> None:
    """``w -= lr * sign(m * beta_1 + g * (1 - beta_1))``, then ``m = m * beta_2 + g * (1 - beta_2)``."""
    lr, beta_1, one_minus_beta_1, beta_2, one_minus_beta_2 = c
    (m,) = slots
    t = m * beta_1
    t += g * one_minus_beta_1
    t = array_module(t).sign(t)
    t *= lr
    w -= t
    m *= beta_2
    m += g * one_minus_beta_2


def ftrl(w, g, slots, c) -> None:
    """Keras' FTRL-Proximal: ``power = -learning_rate_power``, ``n' = n + g*g``,
    ``linear += (g + 2*l2_shrinkage * w) - ((n'^power - n^power) / lr) * w``,
    ``w = (clip(linear, -l1, l1) - linear) / (n'^power / lr + 2 * l2_reg)``, ``n = n'``."""
    lr, power, two_l2_shrinkage, two_l2_reg, l1 = c
    accumulator, linear = slots
    g, squares = _split(g)
    xp = array_module(w)
    new_accumulator = accumulator + squares
    new_power = _power(new_accumulator, power)
    t = new_power - _power(accumulator, power)
    t /= lr
    t *= w
    grad_to_use = w * two_l2_shrinkage
    grad_to_use += g
    grad_to_use -= t
    linear += grad_to_use
    quadratic = new_power / lr
    quadratic += two_l2_reg
    clipped = xp.maximum(xp.minimum(linear, l1), -l1)  # (tf.clip_by_value's order)
    clipped = clipped - linear
    clipped /= quadratic
    w[...] = clipped
    accumulator[...] = new_accumulator


def lamb(w, g, slots, c) -> None:
    """Keras' Lamb: Adam's moments, the step ``update = (m / (1 - beta_1^t)) / (sqrt(v / (1 - beta_2^t)) + epsilon)``
    scaled by the trust ratio ``|w| / |update|`` (1 when either norm is 0): ``w -= (ratio * lr) * update``. The
    norms' sums of squares are added up in the kernels' order (:func:`variable_sum`), so the kernels give these
    bits."""
    one_minus_beta_1, one_minus_beta_2, lr, one_minus_beta_1_power, one_minus_beta_2_power, epsilon = c
    m, v = slots
    _moments(*_split(g), m, v, one_minus_beta_1, one_minus_beta_2)
    xp = array_module(w)
    d = _sqrt(v / one_minus_beta_2_power)
    d += epsilon
    update = m / one_minus_beta_1_power
    update /= d
    w_norm = xp.sqrt(variable_sum(w * w))
    g_norm = xp.sqrt(variable_sum(update * update))
    one = w.dtype.type(1)
    # (Keras' where: both branches computed, 0 / 0 discarded; the norms' dtype is w's.)
    with np.errstate(divide="ignore", invalid="ignore"):
        ratio = xp.where(w_norm > 0, xp.where(g_norm > 0, w_norm / g_norm, one), one).astype(w.dtype)
    update *= ratio * lr
    w -= update


# The order of a sum over a whole variable (csrc/core/variable_sums.h, shared with the kernels).
SUM_LANES, SUM_GROUP = 8192, 64


def variable_sum(x):
    """The sum of ``x``'s elements (squares: >= 0, inf or NaN) in the kernels' order, a 0-d array of x's dtype:
    ``min(n, SUM_LANES)`` lanes, lane p adding elements p, p + lanes, ... in turn; the lanes added in groups of
    ``SUM_GROUP`` in turn, then the groups in turn. Every addition rounds in x's dtype, so NumPy, CuPy and the
    kernels give the same bits (NumPy's own ``sum`` adds pairwise, in another order)."""
    xp = array_module(x)
    flat = x.reshape(-1)
    n = flat.size
    if n == 0:
        return xp.zeros((), x.dtype)
    lanes = min(n, SUM_LANES)
    rows = -(-n // lanes)
    if rows * lanes != n:  # (the last block padded with zeros: s + 0 is s for the terms summed here)
        flat = xp.concatenate([flat, xp.zeros(rows * lanes - n, x.dtype)])
    block = flat.reshape(rows, lanes)
    lane = block[0].copy()
    for r in range(1, rows):
        lane += block[r]
    groups = -(-lanes // SUM_GROUP)
    if groups * SUM_GROUP != lanes:
        lane = xp.concatenate([lane, xp.zeros(groups * SUM_GROUP - lanes, x.dtype)])
    by_group = lane.reshape(groups, SUM_GROUP)
    group = by_group[:, 0].copy()
    for j in range(1, SUM_GROUP):
        group += by_group[:, j]
    total = group[0].copy()
    for g in range(1, groups):
        total += group[g]
    return total


def _rms(x):
    """``sqrt(mean(x * x))`` over every element, in x's dtype: the sum in variable_sum's order, divided by the
    count."""
    return _sqrt(variable_sum(x * x) / x.dtype.type(x.size))


def _sequential_mean(x, axis: int):
    """The mean of ``x`` over ``axis`` (-1 or -2): its elements added in index order (every addition rounded in
    x's dtype, the kernels' order; NumPy's ``mean`` adds pairwise), then divided by their count (0 / 0: NaN, as
    an empty mean)."""
    xp = array_module(x)
    n = x.shape[axis]
    if n == 0:
        total = xp.zeros(x.shape[:axis % x.ndim] + x.shape[axis % x.ndim + 1:], x.dtype)
    elif xp is np:
        total = np.add.accumulate(x, axis=axis).take(-1, axis=axis)  # (a running sum: one element after another)
    else:
        at = (Ellipsis,) + (slice(None),) * (-axis - 1)  # (axis is -1 or -2)
        total = x[at[:1] + (0,) + at[1:]].copy()
        for i in range(1, n):
            total += x[at[:1] + (i,) + at[1:]]
    total /= x.dtype.type(n)
    return total


def adafactor(w, g, slots, c) -> None:
    """Keras' Adafactor: second moments factored over the last two axes of a variable of 2 or more dimensions
    (``r``: the rows' means, ``c``: the columns', ``v = (r / mean(r)) outer c``), a plain moving average ``v``
    for the others (whose ``r`` and ``c`` are Keras' placeholders, untouched); the step ``g / sqrt(v)`` is
    clipped to an RMS of ``clip_threshold`` and scaled by ``max(epsilon_2, rms(w)) * rho_t``. The RMS sums go
    in variable_sum's order and the means add in index order (_sequential_mean): the kernels' orders."""
    rho_t, epsilon_2, epsilon_1, beta_2_t, one_minus_beta_2_t, clip_threshold = c
    r, col, v = slots
    g, regulated = _split(g)
    xp = array_module(w)
    alpha_t = xp.maximum(epsilon_2, _rms(w)) * rho_t
    regulated += epsilon_1
    if w.ndim >= 2:
        # (The array first in each product: a NumPy scalar on the left would convert a CuPy array.)
        r[...] = r * beta_2_t + _sequential_mean(regulated, -1) * one_minus_beta_2_t
        col[...] = col * beta_2_t + _sequential_mean(regulated, -2) * one_minus_beta_2_t
        v[...] = (r / _sequential_mean(r, -1)[..., None])[..., None] * col[..., None, :]
    else:
        v[...] = v * beta_2_t + regulated * one_minus_beta_2_t
    u = g / _sqrt(v)
    u /= xp.maximum(w.dtype.type(1), _rms(u) / clip_threshold)
    u *= alpha_t
    w -= u


def schedule_free_adamw(w, g, slots, c) -> None:
    """Keras' ScheduleFreeAdamW: ``w`` holds y, slot ``momentum`` z and ``velocity`` v. ``v += (g*g - v) *
    (1 - beta_2)``, ``z -= (g * lr) / (sqrt(v / (1 - beta_2^t)) + epsilon)``; then x is recovered from y and
    the *updated* z (Keras reads its momentum variable after the update), ``x = (y - z * (1 - beta_1)) /
    beta_1``, averaged towards z, ``x = x * (1 - 1/t) + z * (1/t)``, and ``y = z * (1 - beta_1) + x * beta_1``."""
    lr, one_minus_beta_2, one_minus_beta_2_power, epsilon, one_minus_beta_1, beta_1, one_minus_weight, weight = c
    z, v = slots
    g, squares = _split(g)
    squares -= v
    squares *= one_minus_beta_2
    v += squares
    d = v / one_minus_beta_2_power
    d = _sqrt(d)
    d += epsilon
    t = g * lr
    t /= d
    z -= t
    x = w - z * one_minus_beta_1
    x /= beta_1
    x *= one_minus_weight
    x += z * weight
    x *= beta_1
    x += z * one_minus_beta_1
    w[...] = x


def muon_momentum(out, g, slots, c) -> None:
    """Muon's momentum, Keras' ``m += g + m * (momentum - 1)``, and the matrix its Newton-Schulz iteration
    orthogonalises, written into ``out`` (the rule's "weight"): ``g + momentum * m`` with Nesterov, else ``m``.
    ``c``: momentum - 1, momentum, nesterov (1 or 0)."""
    momentum_minus_one, momentum, nesterov = c
    g = g.grad if type(g) is SquaredGradient else g
    (m,) = slots
    t = m * momentum_minus_one
    t += g  # (g + t: the same sum)
    m += t
    if nesterov:
        t = m * momentum
        t += g
        out[...] = t
    else:
        out[...] = m


def newton_schulz(x, steps: int, a, b, c):
    """Keras' Newton-Schulz iteration (``Muon.zeropower_via_newtonschulz5``) on a stack of matrices ``x``
    (``(n, rows, cols)``, any array module), batched: one matrix product per step and term for the whole stack.
    A tall matrix (rows > cols) is iterated transposed. Each matrix is divided by its Frobenius norm + 1e-7, then
    ``steps`` times ``A = X X^T``, ``X = a X + (b A + (c A) A) X`` (Keras' order of the products), in x's dtype.
    Returns a new array (a transposed view for tall matrices)."""
    xp = array_module(x)
    matmul = _batched_matmul(xp)
    t = x.dtype.type
    tall = x.shape[-2] > x.shape[-1]
    if tall:
        x = x.transpose(0, 2, 1)
    norm = xp.sqrt((x * x).sum(axis=(-2, -1), keepdims=True))
    norm += t(1e-7)
    x = x / norm
    for _ in range(steps):
        gram = matmul(x, x, transpose_b=True)
        mix = gram * t(b)
        mix += matmul(gram * t(c), gram)
        product = matmul(mix, x)
        x *= t(a)
        x += product
    return x.transpose(0, 2, 1) if tall else x


# The bytes of one chunk's working set in newton_schulz_host (its matrices, their products and three Gram-sized
# matrices): a chunk's whole iteration stays in a core's L2 cache, where the whole stack's would stream through
# memory once per operation.
NS_CHUNK_BYTES = 1 << 20


def newton_schulz_host(x, steps: int, a, b, c, scales=(), chunk_bytes: int = NS_CHUNK_BYTES) -> None:
    """newton_schulz on a C-contiguous NumPy stack ``x`` (``(n, rows, cols)``) in place, bit for bit the same
    values, then ``x *= s`` for each of ``scales`` in turn. The stack is iterated a chunk of matrices at a time
    (``chunk_bytes``: the chunk's whole iteration before the next chunk's), in workspaces allocated once per call:
    every element sees the same operations in the same order, each product the same BLAS call (the same shapes,
    strides and operands per matrix) and each norm the same reduction (the squares in x's layout)."""
    n, rows, cols = x.shape
    t = x.dtype.type
    tall = rows > cols
    m, k = (cols, rows) if tall else (rows, cols)  # the iterated matrices are m x k, m <= k
    per_matrix = (3 * m * m + 2 * m * k) * x.itemsize
    size = max(1, min(n, chunk_bytes // per_matrix))
    # (the squares of the norm share the products' buffer: in x's layout, transposed as x is when tall)
    square_buffer = np.empty((size, rows, cols), x.dtype)
    gram_buffer = np.empty((3, size, m, m), x.dtype)
    a, b, c, tiny = t(a), t(b), t(c), t(1e-7)
    for start in range(0, n, size):
        stop = min(n, start + size)
        j = stop - start
        xs = x[start:stop]
        squares = square_buffer[:j]
        product = squares.reshape(j, m, k)
        gram, scaled, cubed = gram_buffer[0, :j], gram_buffer[1, :j], gram_buffer[2, :j]
        if tall:
            xs, squares = xs.transpose(0, 2, 1), squares.transpose(0, 2, 1)
        np.multiply(xs, xs, out=squares)
        norm = squares.sum(axis=(-2, -1), keepdims=True)
        np.sqrt(norm, out=norm)
        norm += tiny
        np.divide(xs, norm, out=xs)
        for _ in range(steps):
            np.matmul(xs, xs.transpose(0, 2, 1), out=gram)
            np.multiply(gram, c, out=scaled)
            np.matmul(scaled, gram, out=cubed)
            gram *= b  # (b A + (c A) A: gram now b A, the sum's first term, as newton_schulz's ``mix``)
            gram += cubed
            np.matmul(gram, xs, out=product)
            xs *= a
            xs += product
        for s in scales:
            xs *= s


def _batched_matmul(xp):
    """Batched matrix products: NumPy's on host; on a GPU md.linalg.matmul's (one strided-batched cuBLAS call,
    which md.function can capture: CuPy refuses cuBLAS while a stream captures)."""
    if xp is np:
        return lambda p, q, transpose_b=False: np.matmul(p, q.transpose(0, 2, 1) if transpose_b else q)
    from ...device.linalg import matmul

    return matmul


RULES = (sgd, sgd_momentum, sgd_nesterov, adam, rmsprop, adagrad, nadam, adam_amsgrad, ema, adamax, adadelta, lion,
         ftrl, lamb, adafactor, schedule_free_adamw, muon_momentum)


def apply(rule: int, w, g, slots, c) -> None:
    # An overflow or a division by zero (Ftrl at learning rate 0) gives inf or NaN, as TensorFlow's kernels and
    # the fused kernel do, without NumPy's warning.
    with np.errstate(divide="ignore", over="ignore", invalid="ignore"):
        RULES[rule](w, g, slots, c)


def array_module(x):
    """x's own array module: NumPy for NumPy arrays and scalars, CuPy for GPU arrays."""
    if isinstance(x, (np.ndarray, np.generic)):
        return np
    return sys.modules[type(x).__module__.partition(".")[0]]


def _power(x, p):
    """``x ** p`` in x's dtype, computed in float64 and rounded once (the kernels' ``power``): float32 ``pow``
    differs by an ulp between libm, NumPy's SIMD loops and CUDA, float64's rounded to float32 does not. A
    float64 NumPy array takes libm's ``pow`` element by element (``math.pow``), the host kernel's, where
    NumPy's SIMD loop may differ by an ulp (the host kernel takes float64 arrays: this is the reference)."""
    xp = array_module(x)
    if p == 0.5:  # (Keras' default; the same value, for x >= 0, and the kernels' instruction)
        return _sqrt(x)
    if x.dtype == xp.float64:
        if xp is np:
            return np.asarray(_libm_pow(x, float(p)), dtype=np.float64)
        return xp.power(x, p)
    return xp.power(x.astype(xp.float64), xp.float64(p)).astype(x.dtype)


_libm_pow = np.frompyfunc(math.pow, 2, 1)


def _sqrt(x):
    """``sqrt(x)``, a new array."""
    return array_module(x).sqrt(x)
