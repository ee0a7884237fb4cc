#include "net/mesh.h"

#include <gloo/context.h>
#include <gloo/transport/context.h>
#include <gloo/transport/tcp/device.h>
#include <gloo/transport/tcp/loop.h>
#include <gloo/transport/tcp/pair.h>

#include <poll.h>
#include <sys/epoll.h>
#include <sys/eventfd.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <cerrno>
#include <condition_variable>
#include <cstring>
#include <mutex>
#include <system_error>
#include <thread>

#include "net/errors.h"
#include "net/hmac.h"
#include "net/socket.h"
#include "net/store.h"

namespace mirrored::net {
namespace {

namespace tcp = gloo::transport::tcp;

constexpr char kMagic[8] = {'m', 'r', 'd', 'm', 'e', 's', 'h', '1'};
constexpr std::size_t kNonceBytes = 16;
constexpr std::size_t kHelloBytes = sizeof(kMagic) + 4 + 4 + kNonceBytes;
constexpr std::size_t kProofBytes = 32;
constexpr std::size_t kReplyBytes = kNonceBytes + kProofBytes;

void put_u32(std::string& s, std::uint32_t v) {
  for (int i = 0; i < 4; ++i) s.push_back(static_cast<char>(v >> (8 * i)));
}

std::uint32_t get_u32(const std::string& s, std::size_t at) {
  std::uint32_t v = 0;
  for (int i = 0; i < 4; ++i) v |= std::uint32_t{static_cast<unsigned char>(s[at + i])} << (8 * i);
  return v;
}

std::string hello(int client, int server, const std::string& nonce) {
  std::string h(kMagic, sizeof(kMagic));
  put_u32(h, static_cast<std::uint32_t>(client));
  put_u32(h, static_cast<std::uint32_t>(server));
  return h + nonce;
}

// What each side proves: that it holds the token, for this hello and this server nonce.
std::string proof(const std::string& token, const char* role, const std::string& scope, const std::string& hello,
                  const std::string& server_nonce) {
  const Digest d = hmac_sha256(token, std::string(role) + '\0' + scope + '\0' + hello + server_nonce);
  return std::string(d.begin(), d.end());
}

bool same_proof(const std::string& a, const std::string& b) {
  if (a.size() != kProofBytes || b.size() != kProofBytes) return false;
  Digest x, y;
  std::memcpy(x.data(), a.data(), kProofBytes);
  std::memcpy(y.data(), b.data(), kProofBytes);
  return same_digest(x, y);
}

struct Endpoint {
  std::string host;
  int port = 0;
  std::string str() const { return host + ":" + std::to_string(port); }
};

Deadline sooner(Deadline a, std::chrono::milliseconds b) { return std::min(a, after(b)); }

// This process's end of the connection to lower-ranked `server`, authenticated.
Socket connect_to(const Endpoint& at, int me, int server, const std::vector<std::string>& tasks,
                  const std::string& token, const std::string& scope, Deadline deadline,
                  std::chrono::milliseconds timeout) {
  const std::string who = "task " + tasks[server] + " at " + at.str();
  const std::string refused = std::system_category().message(ECONNREFUSED);
  std::string last = "no answer";
  for (;;) {
    if (Clock::now() >= deadline)
      throw PeerTimeout("connecting the Gloo mesh: " + who + " did not admit task " + tasks[me] + " within " +
                        seconds(timeout) + " (" + last + ")");
    std::string error;
    Socket s = try_connect(at.host, at.port, sooner(deadline, kHandshakeLimit), &error);
    if (!s.valid()) {
      // It listens until every higher rank is in: refused means it is gone.
      if (error == refused)
        throw PeerLost("connecting the Gloo mesh: " + who + " refused the connection (did it exit?)");
      last = error;
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    }
    const std::string mine = hello(me, server, random_bytes(kNonceBytes));
    std::string reply(kReplyBytes, '\0');
    char admitted = 0;
    try {
      const Deadline step = sooner(deadline, kHandshakeLimit);
      s.write_all(mine.data(), mine.size(), step);
      s.read_exact(reply.data(), reply.size(), step);
      const std::string server_nonce = reply.substr(0, kNonceBytes);
      if (!same_proof(reply.substr(kNonceBytes), proof(token, "server", scope, mine, server_nonce)))
        throw Refused("connecting the Gloo mesh: the process at " + at.str() + " is not task " + tasks[server] +
                      " of this job (it cannot prove it holds the job token)");
      const std::string mine_proof = proof(token, "client", scope, mine, server_nonce);
      s.write_all(mine_proof.data(), mine_proof.size(), step);
      s.read_exact(&admitted, 1, step);
    } catch (const PeerLost& e) {
      // Dropped before the end, e.g. while the server shed a flood of strangers: connect again.
      last = e.what();
      std::this_thread::sleep_for(std::chrono::milliseconds(50));
      continue;
    } catch (const PeerTimeout& e) {
      last = e.what();
      continue;
    }
    if (admitted == 1) return s;
    last = "not admitted";
  }
}

// Accepts, on `listener`, one authenticated connection from every rank above
// `me`; anything else that connects is closed, and accepting goes on.
void serve(const Socket& listener, int me, const std::vector<std::string>& tasks, const std::string& token,
           const std::string& scope, Deadline deadline, std::chrono::milliseconds timeout,
           std::vector<Socket>& conns) {
  struct Pending {
    Socket sock;
    Deadline until;
    std::string got;        // bytes of the current message so far
    std::string hello;      // once received
    std::string nonce;      // ours, once the hello was answered
  };
  std::vector<Pending> pending;
  const int n = static_cast<int>(tasks.size());
  auto left = [&] {
    std::vector<std::string> who;
    for (int r = me + 1; r < n; ++r)
      if (!conns[r].valid()) who.push_back(tasks[r]);
    return who;
  };
  // One step of connection p's handshake; false: drop it.
  auto advance = [&](Pending& p) {
    const std::size_t need = p.hello.empty() ? kHelloBytes : kProofBytes;
    char buf[kHelloBytes];
    const ssize_t r = ::recv(p.sock.fd(), buf, need - p.got.size(), MSG_DONTWAIT);
    if (r == 0) return false;
    if (r < 0) return errno == EAGAIN || errno == EWOULDBLOCK || errno == EINTR;
    p.got.append(buf, static_cast<std::size_t>(r));
    if (p.got.size() < need) return true;
    try {
      if (p.hello.empty()) {
        const int client = static_cast<int>(get_u32(p.got, sizeof(kMagic)));
        const int server = static_cast<int>(get_u32(p.got, sizeof(kMagic) + 4));
        if (std::memcmp(p.got.data(), kMagic, sizeof(kMagic)) != 0 || server != me || client <= me || client >= n ||
            conns[client].valid())
          return false;
        p.hello = std::move(p.got);
        p.got.clear();
        p.nonce = random_bytes(kNonceBytes);
        const std::string reply = p.nonce + proof(token, "server", scope, p.hello, p.nonce);
        p.sock.write_all(reply.data(), reply.size(), sooner(p.until, std::chrono::milliseconds(1000)));
        return true;
      }
      if (!same_proof(p.got, proof(token, "client", scope, p.hello, p.nonce))) return false;
      const char admitted = 1;
      p.sock.write_all(&admitted, 1, sooner(p.until, std::chrono::milliseconds(1000)));
    } catch (const std::exception&) {
      return false;  // it stopped reading or went away
    }
    conns[get_u32(p.hello, sizeof(kMagic))] = std::move(p.sock);
    return false;  // done with it: no longer pending
  };
  while (!left().empty()) {
    const Deadline now = Clock::now();
    if (now >= deadline)
      throw PeerTimeout("connecting the Gloo mesh: task(s) " + join(left()) + " did not connect to task " + tasks[me] +
                        " within " + seconds(timeout) + " (did it crash while starting?)");
    pending.erase(std::remove_if(pending.begin(), pending.end(), [&](const Pending& p) { return now >= p.until; }),
                  pending.end());
    Deadline next = deadline;
    std::vector<pollfd> fds{{listener.fd(), POLLIN, 0}};
    for (const auto& p : pending) {
      fds.push_back({p.sock.fd(), POLLIN, 0});
      next = std::min(next, p.until);
    }
    const auto wait = std::chrono::duration_cast<std::chrono::milliseconds>(next - now).count() + 1;
    if (::poll(fds.data(), fds.size(), static_cast<int>(std::min<long long>(wait, 1000))) < 0 && errno != EINTR)
      throw PeerLost(std::string("connecting the Gloo mesh: poll failed: ") + std::strerror(errno));
    std::vector<Pending> kept;
    for (std::size_t i = 0; i < pending.size(); ++i)
      if (!fds[i + 1].revents || advance(pending[i])) kept.push_back(std::move(pending[i]));
    pending = std::move(kept);
    if (fds[0].revents & POLLIN) {
      for (;;) {
        int error = 0;
        Socket s = accept_now(listener, &error);
        if (!s.valid()) break;  // none left (or out of descriptors: the pending ones expire first)
        if (static_cast<int>(pending.size()) >= kMaxPendingConnections) pending.erase(pending.begin());
        pending.push_back(Pending{std::move(s), sooner(deadline, kHandshakeLimit), {}, {}, {}});
      }
    }
  }
}

// Holds Gloo's event loop inside a handler of ours, so that nothing can reach
// the listeners its pairs open while we replace them with our connections.
class LoopGate : public tcp::Handler {
 public:
  explicit LoopGate(tcp::Device& device) : device_(device), fd_(::eventfd(0, EFD_CLOEXEC | EFD_NONBLOCK)) {
    if (fd_ < 0) throw std::system_error(errno, std::system_category(), "eventfd");
    device_.registerDescriptor(fd_, EPOLLIN, this);
    const std::uint64_t one = 1;
    bool parked = ::write(fd_, &one, sizeof(one)) == sizeof(one);
    if (parked) {
      std::unique_lock<std::mutex> lock(mu_);
      parked = cv_.wait_for(lock, std::chrono::seconds(60), [this] { return parked_; });
    }
    if (!parked) {
      close();
      throw std::runtime_error("connecting the Gloo mesh: Gloo's event loop did not answer within 60 s");
    }
  }
  ~LoopGate() override { close(); }
  LoopGate(const LoopGate&) = delete;
  LoopGate& operator=(const LoopGate&) = delete;

  void handleEvents(int) override {
    // Drained first, under our own lock's ordering: the loop will not call us
    // again, and close() (after parked_) cannot race this read.
    std::uint64_t v = 0;
    const bool drained = ::read(fd_, &v, sizeof(v)) == sizeof(v);
    std::unique_lock<std::mutex> lock(mu_);
    if (!drained) return;
    parked_ = true;
    cv_.notify_all();
    cv_.wait(lock, [this] { return released_; });
    left_ = true;  // the last time this thread touches the gate
    cv_.notify_all();
  }

 private:
  void close() {
    {
      std::unique_lock<std::mutex> lock(mu_);
      released_ = true;
      cv_.notify_all();
      if (parked_) cv_.wait(lock, [this] { return left_; });
    }
    device_.unregisterDescriptor(fd_, this);
    ::close(fd_);
  }

  tcp::Device& device_;
  const int fd_;
  std::mutex mu_;
  std::condition_variable cv_;
  bool parked_ = false;
  bool released_ = false;
  bool left_ = false;
};

// Gloo's pair keeps its socket and state to itself; a derived class may name
// them (access through member pointers formed here).
struct PairAccess : tcp::Pair {
  // Makes `pair` use `fd`, an authenticated connection to its peer, closing
  // the listener it opened. Gloo's loop must be held (LoopGate).
  static void adopt(tcp::Pair& pair, int fd) {
    std::lock_guard<std::mutex> lock(pair.*(&PairAccess::m_));
    if (pair.*(&PairAccess::state_) != LISTENING) {
      ::close(fd);
      throw std::logic_error("connecting the Gloo mesh: a Gloo pair was not listening");
    }
    int& own = pair.*(&PairAccess::fd_);
    ::close(own);  // also leaves the loop's epoll set: nothing else refers to that socket
    own = fd;
    (pair.*(&PairAccess::handleConnected))();
  }
};

// A Gloo context over a transport context whose pairs are connected already.
class MeshContext : public gloo::Context {
 public:
  MeshContext(int rank, int size, std::shared_ptr<gloo::transport::Device> device,
              std::shared_ptr<gloo::transport::Context> transport, std::chrono::milliseconds timeout)
      : gloo::Context(rank, size) {
    device_ = std::move(device);
    transportContext_ = std::move(transport);
    setTimeout(timeout);
  }
};

}  // namespace

std::shared_ptr<gloo::Context> connect_mesh(StoreClient& store, const std::string& prefix,
                                            const std::vector<std::string>& tasks, const std::string& host,
                                            std::chrono::milliseconds timeout) {
  const int me = store.rank();
  const int n = static_cast<int>(tasks.size());
  const Deadline deadline = after(timeout);
  const std::string scope = prefix + "mesh";

  int port = 0;
  Socket listener = listen_on(host, 0, &port);
  const std::string mine = host + " " + std::to_string(port);
  store.set(prefix + "mesh/" + std::to_string(me), std::vector<char>(mine.begin(), mine.end()));
  std::vector<std::string> keys;
  for (int r = 0; r < me; ++r) keys.push_back(prefix + "mesh/" + std::to_string(r));
  const auto missing = store.wait(keys, timeout);
  if (!missing.empty()) {
    std::vector<std::string> who;
    for (const auto& m : missing) who.push_back(tasks[std::stoi(m.substr(m.rfind('/') + 1))]);
    throw PeerTimeout("connecting the Gloo mesh: " + join(who) + " did not publish an address within " +
                      seconds(timeout) + " (did it crash while starting?)");
  }
  std::vector<Socket> conns(n);
  for (int r = 0; r < me; ++r) {
    const auto v = store.get(keys[r]);
    const std::string text(v.begin(), v.end());
    const auto space = text.rfind(' ');
    const Endpoint at{text.substr(0, space), std::stoi(text.substr(space + 1))};
    conns[r] = connect_to(at, me, r, tasks, store.token(), scope, deadline, timeout);
  }
  serve(listener, me, tasks, store.token(), scope, deadline, timeout, conns);
  listener = Socket();

  gloo::transport::tcp::attr attr;
  attr.hostname = host;
  auto device = tcp::CreateDevice(attr);
  auto transport = device->createContext(me, n);
  transport->setTimeout(timeout);
  {
    LoopGate gate(static_cast<tcp::Device&>(*device));
    for (int r = 0; r < n; ++r) {
      if (r == me) continue;
      auto& pair = static_cast<tcp::Pair&>(*transport->createPair(r));
      PairAccess::adopt(pair, conns[r].release());
    }
  }
  return std::make_shared<MeshContext>(me, n, std::move(device), std::move(transport), timeout);
}

}  // namespace mirrored::net
