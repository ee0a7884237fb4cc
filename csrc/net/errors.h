// The ways a multi-worker operation fails, so that Python can raise
// TimeoutError / ConnectionError / PermissionError / ValueError /
// KeyboardInterrupt and users can tell "a peer is slow or stuck" from "a peer
// is gone" from "this task is not welcome" from "the workers disagree".
#pragma once

#include <chrono>
#include <stdexcept>
#include <string>
#include <vector>

namespace mirrored::net {

// A peer did not arrive (at rendezvous or at a collective) within the timeout.
struct PeerTimeout : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// A peer's connection closed or reset: its process exited or its host is unreachable.
struct PeerLost : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The rendezvous store refused this task: wrong job token or task index.
struct Refused : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// The workers of a collective disagree on what it is (kind, size, dtype, op,
// root, ...): found before any data moved, and the same on every worker.
struct CollectiveMismatch : std::invalid_argument {
  using std::invalid_argument::invalid_argument;
};

// A wait was interrupted by a signal whose handler raised (Ctrl-C): the
// binding's wait hook left the Python exception set; it surfaces unchanged.
struct Interrupted : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// For messages: "a, b, c".
inline std::string join(const std::vector<std::string>& names) {
  std::string s;
  for (const auto& n : names) s += (s.empty() ? "" : ", ") + n;
  return s;
}

// For messages: "2.5 s".
inline std::string seconds(std::chrono::milliseconds ms) {
  return std::to_string(ms.count() / 1000) + "." + std::to_string(ms.count() % 1000 / 100) + " s";
}

}  // namespace mirrored::net
