#include "net/socket.h"

#include <fcntl.h>
#include <netdb.h>
#include <netinet/in.h>
#include <netinet/tcp.h>
#include <poll.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <memory>
#include <system_error>

#include "net/errors.h"

namespace mirrored::net {
namespace {

std::string errno_text(int err) { return std::system_category().message(err); }

// Milliseconds left until `deadline`, as poll() wants them (-1: no deadline).
int poll_ms(Deadline deadline) {
  if (deadline == never()) return -1;
  const auto left = std::chrono::duration_cast<std::chrono::milliseconds>(deadline - Clock::now()).count();
  return static_cast<int>(std::clamp<long long>(left, 0, 1 << 30));
}

void wait_ready(int fd, short events, Deadline deadline, const char* what) {
  for (;;) {
    pollfd p{fd, events, 0};
    const int r = ::poll(&p, 1, poll_ms(deadline));
    if (r > 0) return;  // readable/writable or hung up: the following call tells which
    if (r == 0) throw PeerTimeout(std::string("timed out while ") + what);
    if (errno != EINTR) throw PeerLost(std::string("poll failed while ") + what + ": " + errno_text(errno));
  }
}

struct AddrInfo {
  addrinfo* list = nullptr;
  ~AddrInfo() { if (list) ::freeaddrinfo(list); }
};

void resolve(const std::string& host, int port, bool passive, AddrInfo* out) {
  addrinfo hints{};
  hints.ai_family = AF_UNSPEC;
  hints.ai_socktype = SOCK_STREAM;
  hints.ai_flags = passive ? AI_PASSIVE : 0;
  const std::string service = std::to_string(port);
  const int rc = ::getaddrinfo(host.c_str(), service.c_str(), &hints, &out->list);
  if (rc != 0) throw PeerLost("cannot resolve host '" + host + "': " + ::gai_strerror(rc));
}

}  // namespace

Socket::~Socket() {
  if (fd_ >= 0) ::close(fd_);
}

Socket& Socket::operator=(Socket&& o) noexcept {
  if (this != &o) {
    if (fd_ >= 0) ::close(fd_);
    fd_ = o.fd_;
    o.fd_ = -1;
  }
  return *this;
}

void Socket::write_all(const void* data, std::size_t n, Deadline deadline) {
  const char* p = static_cast<const char*>(data);
  while (n > 0) {
    wait_ready(fd_, POLLOUT, deadline, "sending");
    // MSG_NOSIGNAL: a peer that vanished must surface as an error, not SIGPIPE.
    const ssize_t w = ::send(fd_, p, n, MSG_NOSIGNAL | MSG_DONTWAIT);
    if (w < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw PeerLost("connection lost while sending: " + errno_text(errno));
    }
    p += w;
    n -= static_cast<std::size_t>(w);
  }
}

void Socket::read_exact(void* data, std::size_t n, Deadline deadline) {
  char* p = static_cast<char*>(data);
  while (n > 0) {
    wait_ready(fd_, POLLIN, deadline, "receiving");
    const ssize_t r = ::recv(fd_, p, n, MSG_DONTWAIT);
    if (r == 0) throw PeerLost("connection closed by the peer");
    if (r < 0) {
      if (errno == EINTR || errno == EAGAIN || errno == EWOULDBLOCK) continue;
      throw PeerLost("connection lost while receiving: " + errno_text(errno));
    }
    p += r;
    n -= static_cast<std::size_t>(r);
  }
}

bool Socket::peer_closed() const {
  char c;
  const ssize_t r = ::recv(fd_, &c, 1, MSG_PEEK | MSG_DONTWAIT);
  return r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK && errno != EINTR);
}

void Socket::shutdown() {
  if (fd_ >= 0) ::shutdown(fd_, SHUT_RDWR);
}

Socket listen_on(const std::string& host, int port, int* bound_port) {
  AddrInfo ai;
  resolve(host, port, true, &ai);
  std::string last = "no address";
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!s.valid()) { last = errno_text(errno); continue; }
    // A restarted job must be able to rebind at once, not after TIME_WAIT.
    const int one = 1;
    ::setsockopt(s.fd(), SOL_SOCKET, SO_REUSEADDR, &one, sizeof(one));
    if (::bind(s.fd(), a->ai_addr, a->ai_addrlen) != 0 || ::listen(s.fd(), 128) != 0) {
      last = errno_text(errno);
      continue;
    }
    sockaddr_storage addr{};
    socklen_t len = sizeof(addr);
    ::getsockname(s.fd(), reinterpret_cast<sockaddr*>(&addr), &len);
    *bound_port = ntohs(addr.ss_family == AF_INET6 ? reinterpret_cast<sockaddr_in6*>(&addr)->sin6_port
                                                    : reinterpret_cast<sockaddr_in*>(&addr)->sin_port);
    return s;
  }
  throw PeerLost("cannot listen on " + host + ":" + std::to_string(port) + ": " + last);
}

Socket try_connect(const std::string& host, int port, Deadline deadline, std::string* error) {
  AddrInfo ai;
  try {
    resolve(host, port, false, &ai);
  } catch (const PeerLost& e) {
    *error = e.what();
    return Socket();
  }
  for (addrinfo* a = ai.list; a; a = a->ai_next) {
    Socket s(::socket(a->ai_family, a->ai_socktype | SOCK_CLOEXEC | SOCK_NONBLOCK, a->ai_protocol));
    if (!s.valid()) { *error = errno_text(errno); continue; }
    if (::connect(s.fd(), a->ai_addr, a->ai_addrlen) != 0) {
      if (errno != EINPROGRESS) { *error = errno_text(errno); continue; }
      pollfd p{s.fd(), POLLOUT, 0};
      if (::poll(&p, 1, poll_ms(deadline)) <= 0) { *error = "connect timed out"; continue; }
      int err = 0;
      socklen_t len = sizeof(err);
      ::getsockopt(s.fd(), SOL_SOCKET, SO_ERROR, &err, &len);
      if (err != 0) { *error = errno_text(err); continue; }
    }
    // Store requests are small and latency-bound.
    const int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
    return s;
  }
  return Socket();
}

Socket accept_for(const Socket& listener, std::chrono::milliseconds wait) {
  pollfd p{listener.fd(), POLLIN, 0};
  if (::poll(&p, 1, static_cast<int>(wait.count())) <= 0) return Socket();
  Socket s(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  if (s.valid()) {
    const int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return s;
}

Socket accept_now(const Socket& listener, int* error) {
  Socket s(::accept4(listener.fd(), nullptr, nullptr, SOCK_CLOEXEC | SOCK_NONBLOCK));
  *error = s.valid() ? 0 : errno;
  if (s.valid()) {
    const int one = 1;
    ::setsockopt(s.fd(), IPPROTO_TCP, TCP_NODELAY, &one, sizeof(one));
  }
  return s;
}

Encoder& Encoder::u8(std::uint8_t v) {
  buf_.push_back(static_cast<char>(v));
  return *this;
}

Encoder& Encoder::u32(std::uint32_t v) {
  for (int i = 0; i < 4; ++i) buf_.push_back(static_cast<char>((v >> (8 * i)) & 0xffu));
  return *this;
}

Encoder& Encoder::i64(std::int64_t v) {
  const auto u = static_cast<std::uint64_t>(v);
  for (int i = 0; i < 8; ++i) buf_.push_back(static_cast<char>((u >> (8 * i)) & 0xffu));
  return *this;
}

Encoder& Encoder::bytes(const void* p, std::size_t n) {
  u32(static_cast<std::uint32_t>(n));
  const char* c = static_cast<const char*>(p);
  buf_.insert(buf_.end(), c, c + n);
  return *this;
}

std::uint8_t Decoder::u8() {
  std::uint8_t v;
  sock.read_exact(&v, 1, deadline);
  return v;
}

std::uint32_t Decoder::u32() {
  unsigned char b[4];
  sock.read_exact(b, 4, deadline);
  return b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
}

std::int64_t Decoder::i64() {
  unsigned char b[8];
  sock.read_exact(b, 8, deadline);
  std::uint64_t u = 0;
  for (int i = 7; i >= 0; --i) u = (u << 8) | b[i];
  return static_cast<std::int64_t>(u);
}

std::vector<char> Decoder::bytes(std::size_t limit) {
  const std::uint32_t n = u32();
  if (n > limit) throw PeerLost("protocol error: a field of " + std::to_string(n) + " bytes exceeds the limit");
  std::vector<char> v(n);
  sock.read_exact(v.data(), n, deadline);
  return v;
}

std::string Decoder::str(std::size_t limit) {
  const auto v = bytes(limit);
  return std::string(v.begin(), v.end());
}

}  // namespace mirrored::net
