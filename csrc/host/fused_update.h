// The fused optimizer update on host memory: one call applies weight decay and
// an optimizer's rule to every variable (and its slots) of one device, walking a
// table of (pointer, count) entries — the multi-tensor-apply way. The table and
// the element math are core/optimizer_rules.h's, shared with the CUDA kernel;
// Lamb, whose trust ratio needs each variable's norms, takes two passes over
// each variable (core/lamb.h).
#pragma once

#include <cstddef>
#include <cstdint>

#include "core/optimizer_rules.h"

namespace mirrored::host {

using rules::FusedEntry;
using rules::FusedScalars;
using rules::kMaxSlots;
using rules::Rule;
using rules::rule_coefficients;
using rules::rule_slots;


// Applies `rule` to entries[0..n). Entries must not overlap each other.
template <typename T>
void fused_update(Rule rule, const FusedEntry<T>* entries, std::size_t n, const FusedScalars<T>& s);

extern template void fused_update<float>(Rule, const FusedEntry<float>*, std::size_t, const FusedScalars<float>&);
extern template void fused_update<double>(Rule, const FusedEntry<double>*, std::size_t, const FusedScalars<double>&);

// The same update with each entry's gradient summed across `replicas` (>= 2) in-process replicas
// first: entries[k].grad is replica 0's, others[k * (replicas - 1) + r - 1] replica r's. The sum is
// ((g0 + g1) + g2) + ..., the order of HostCommunicator's direct fold, so the update gets the
// all-reduced gradient bit for bit without the gradients being packed and all-reduced first.
template <typename T>
void fused_update_summed(Rule rule, const FusedEntry<T>* entries, std::size_t n, const T* const* others,
                         int replicas, const FusedScalars<T>& s);

extern template void fused_update_summed<float>(Rule, const FusedEntry<float>*, std::size_t, const float* const*,
                                                int, const FusedScalars<float>&);
extern template void fused_update_summed<double>(Rule, const FusedEntry<double>*, std::size_t, const double* const*,
                                                 int, const FusedScalars<double>&);

// An IndexedSlices gradient densified for the fused update, one pass, no sort:
// out[indices[i]] += values[i] (rows of `width` elements, `rows` of them) for
// each i in order, so a repeated row adds its slices in their order; with
// `squares` (else null), squares[indices[i]] += values[i] * values[i] as well
// (FusedEntry::squares). A negative index is skipped; returns -1, or the first
// i whose index is `rows` or more (then nothing is written).
template <typename T>
std::ptrdiff_t scatter_add_rows(T* out, T* squares, std::size_t rows, std::size_t width, const T* values,
                                const std::int64_t* indices, std::size_t n);

extern template std::ptrdiff_t scatter_add_rows<float>(float*, float*, std::size_t, std::size_t, const float*,
                                                       const std::int64_t*, std::size_t);
extern template std::ptrdiff_t scatter_add_rows<double>(double*, double*, std::size_t, std::size_t, const double*,
                                                        const std::int64_t*, std::size_t);

}  // namespace mirrored::host
