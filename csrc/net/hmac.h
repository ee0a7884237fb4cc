// HMAC-SHA256 (RFC 2104 over FIPS 180-4), for proving knowledge of the job
// token without sending it: the Gloo mesh handshake and the shared segment's
// seal. Small inputs only; nothing here is on a data path.
#pragma once

#include <array>
#include <cstddef>
#include <cstdint>
#include <string>

namespace mirrored::net {

using Digest = std::array<std::uint8_t, 32>;

class Sha256 {
 public:
  Sha256();
  Sha256& update(const void* data, std::size_t n);
  Sha256& update(const std::string& s) { return update(s.data(), s.size()); }
  Digest finish();

 private:
  void block(const std::uint8_t* p);
  std::uint32_t h_[8];
  std::uint8_t buf_[64];
  std::size_t used_ = 0;
  std::uint64_t total_ = 0;
};

// HMAC-SHA256 of `message` under `key`.
Digest hmac_sha256(const std::string& key, const std::string& message);

// Equality in time independent of where the digests differ.
bool same_digest(const Digest& a, const Digest& b);

// `n` bytes from the kernel's random source (getrandom); throws if it fails.
std::string random_bytes(std::size_t n);

}  // namespace mirrored::net
