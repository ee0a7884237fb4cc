// Adafactor's fused update on host memory (core/adafactor_rule.h): every variable of a table in one call,
// fused_update's (host/fused_update.h) route for Rule::kAdafactor.
#pragma once

#include <cstddef>

#include "core/optimizer_rules.h"

namespace mirrored::host {

// Adafactor on entries[0..n) (each with its FactoredShape and slots r, c, v). `others`: null, or `more`
// further gradients per entry (fused_update_summed's layout), summed into replica 0's in replica order first.
template <typename T>
void fused_adafactor(const rules::FusedEntry<T>* entries, std::size_t n, const T* const* others, int more,
                     const rules::FusedScalars<T>& s);

extern template void fused_adafactor<float>(const rules::FusedEntry<float>*, std::size_t, const float* const*, int,
                                            const rules::FusedScalars<float>&);
extern template void fused_adafactor<double>(const rules::FusedEntry<double>*, std::size_t, const double* const*,
                                             int, const rules::FusedScalars<double>&);

}  // namespace mirrored::host
