// Stands in for gloo/common/memory.h where a Gloo install lacks it (Debian's
// libgloo-dev ships gloo/transport/tcp/pair.h, which includes it, without it).
// mesh.cc reads only members of tcp::Pair declared before any member whose
// layout depends on these types, so classes of the same shape suffice; none of
// their functions is declared, so none can be called by mistake.
#pragma once

#include <memory>

namespace gloo {

template <typename T>
class NonOwningPtr final {
  std::shared_ptr<T> ptr_;
};

template <typename T>
class WeakNonOwningPtr final {
  std::weak_ptr<T> ptr_;
};

template <typename T>
class ShareableNonOwningPtr final {
  std::shared_ptr<T> ptr_;
};

}  // namespace gloo
