// Blocking TCP sockets with deadlines: just enough for the rendezvous store.
// Every wait goes through poll() so that no call outlives its deadline.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace mirrored::net {

using Clock = std::chrono::steady_clock;
using Deadline = Clock::time_point;
inline Deadline never() { return Deadline::max(); }
// Saturates: a huge or "no timeout" duration means never, not an overflowed past.
inline Deadline after(std::chrono::milliseconds d) {
  const Deadline now = Clock::now();
  if (d.count() <= 0) return now;
  if (d >= std::chrono::duration_cast<std::chrono::milliseconds>(Deadline::max() - now)) return never();
  return now + d;
}

class Socket {
 public:
  Socket() = default;
  explicit Socket(int fd) : fd_(fd) {}
  ~Socket();
  Socket(Socket&& o) noexcept : fd_(o.fd_) { o.fd_ = -1; }
  Socket& operator=(Socket&& o) noexcept;
  Socket(const Socket&) = delete;
  Socket& operator=(const Socket&) = delete;

  int fd() const { return fd_; }
  bool valid() const { return fd_ >= 0; }
  // Gives up ownership: the caller closes the descriptor.
  int release() {
    const int fd = fd_;
    fd_ = -1;
    return fd;
  }

  // Both throw PeerLost on a closed/reset connection and PeerTimeout at the deadline.
  void write_all(const void* data, std::size_t n, Deadline deadline);
  void read_exact(void* data, std::size_t n, Deadline deadline);
  // True when the peer has closed its end (checked without blocking or consuming data).
  bool peer_closed() const;
  // Wakes any thread blocked on this socket (used at server shutdown).
  void shutdown();

 private:
  int fd_ = -1;
};

// A non-blocking listening socket bound to exactly host:port (port 0: any free port, see bound_port).
Socket listen_on(const std::string& host, int port, int* bound_port);
// A connected socket, or an invalid one with *error set; never waits past deadline.
Socket try_connect(const std::string& host, int port, Deadline deadline, std::string* error);
// Accepts one connection if one arrives within `wait`; invalid Socket otherwise.
Socket accept_for(const Socket& listener, std::chrono::milliseconds wait);
// Accepts one pending connection without waiting (non-blocking, TCP_NODELAY);
// an invalid Socket with *error = errno (EAGAIN: none pending, EMFILE: out of descriptors).
Socket accept_now(const Socket& listener, int* error);

// Length-prefixed little-endian framing shared by the store's client and server.
class Encoder {
 public:
  Encoder& u8(std::uint8_t v);
  Encoder& u32(std::uint32_t v);
  Encoder& i64(std::int64_t v);
  Encoder& bytes(const void* p, std::size_t n);
  Encoder& str(const std::string& s) { return bytes(s.data(), s.size()); }
  const std::vector<char>& data() const { return buf_; }

 private:
  std::vector<char> buf_;
};

struct Decoder {
  Socket& sock;
  Deadline deadline;
  std::uint8_t u8();
  std::uint32_t u32();
  std::int64_t i64();
  // A length-prefixed byte string of at most `limit` bytes (a longer one is a protocol error).
  std::vector<char> bytes(std::size_t limit);
  std::string str(std::size_t limit);
};

}  // namespace mirrored::net
