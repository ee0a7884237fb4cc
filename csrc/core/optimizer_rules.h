// The optimizers' update rules on one element, shared by the host kernel
// (csrc/host/fused_update.cc) and the CUDA kernel (csrc/cuda/fused_update.cu):
// Keras 3's element-wise sequences in the variable's dtype T, every operation
// rounded on its own (both are compiled without contraction into fused
// multiply-adds), so host and device give the same bits as
// python/mirrored/train/optimizers/rules.py, the reference.
//
// Each returns the new weight and updates the slots it is given; `c` holds the
// rule's scalars in rules.py's order.
#pragma once

#include <cmath>

#if defined(__CUDACC__)
#define MIRRORED_HD __host__ __device__
#else
#define MIRRORED_HD
#endif

namespace mirrored::rules {

using std::sqrt;

// Keras' decoupled weight decay, before the rule.
template <typename T>
MIRRORED_HD inline T decayed(T w, T weight_decay, T lr) {
  return w - (w * weight_decay) * lr;
}

template <typename T>
MIRRORED_HD inline T sgd(T w, T g, const T* c) {
  return w - g * c[0];
}

template <typename T, bool Nesterov>
MIRRORED_HD inline T sgd_momentum(T w, T g, T& m, const T* c) {
  const T lr = c[0], mu = c[1];
  m = m * mu - g * lr;
  return Nesterov ? w + (m * mu - g * lr) : w + m;
}

template <typename T>
MIRRORED_HD inline T adam(T w, T g, T& m, T& v, const T* c) {
  m = m + (g - m) * c[0];
  v = v + (g * g - v) * c[1];
  return w - (m * c[2]) / (sqrt(v) + c[3]);
}

// slots: velocity, then the average gradient (Centered), then the momentum (Momentum).
template <typename T, bool Centered, bool Momentum>
MIRRORED_HD inline T rmsprop(T w, T g, T& v, T& a, T& mom, const T* c) {
  const T lr = c[0], rho = c[1], one_minus_rho = c[2], epsilon = c[3], mu = c[4];
  v = v * rho + (g * g) * one_minus_rho;
  T denominator;
  if (Centered) {
    a = a * rho + g * one_minus_rho;
    denominator = (v - a * a) + epsilon;
  } else {
    denominator = v + epsilon;
  }
  const T increment = (g * lr) / sqrt(denominator);
  if (Momentum) {
    mom = mom * mu + increment;
    return w - mom;
  }
  return w - increment;
}

template <typename T>
MIRRORED_HD inline T adagrad(T w, T g, T& acc, const T* c) {
  acc = acc + g * g;
  return w - (g * c[0]) / sqrt(acc + c[1]);
}

// c: lr, epsilon, 1-beta_1, 1-beta_2, u_t_1, 1-u_product_t_1, 1-u_t, 1-u_product_t, 1-beta_2^t
template <typename T>
MIRRORED_HD inline T nadam(T w, T g, T& m, T& v, const T* c) {
  m = m + (g - m) * c[2];
  v = v + (g * g - v) * c[3];
  const T m_hat = (m * c[4]) / c[5] + (g * c[6]) / c[7];
  return w - (m_hat * c[0]) / (sqrt(v / c[8]) + c[1]);
}

}  // namespace mirrored::rules
