#include "net/store.h"

#include <fcntl.h>
#include <poll.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <list>
#include <random>
#include <stdexcept>
#include <unordered_map>

#include "net/errors.h"

namespace mirrored::net {
namespace {

// Wire format (little-endian, see Encoder): a handshake (magic, token, rank,
// instance), then requests that each start with an opcode. Every request but
// kProgress gets a reply.
constexpr char kMagic[4] = {'M', 'R', 'V', '2'};
enum Op : std::uint8_t { kSet = 1, kGet = 2, kWait = 3, kProgress = 4, kStatus = 5 };
enum Admission : std::uint8_t { kAdmitted = 0, kBadToken = 1, kBadRank = 2, kDuplicate = 3, kStale = 4, kBusy = 5 };

constexpr std::size_t kMaxToken = 1024;
constexpr std::size_t kMaxInstance = 256;
constexpr std::size_t kMaxKey = 4096;
constexpr std::uint32_t kMaxWaitKeys = 4096;
constexpr std::size_t kMaxHandshake = 4 + 4 + kMaxToken + 8 + 4 + kMaxInstance;
// What a client accepts in a reply: above any server's value limit.
constexpr std::size_t kMaxReplyValue = std::size_t{64} << 20;
// The longest the loop sleeps, and the most it reads from one connection per turn (fairness).
constexpr std::chrono::milliseconds kTick{200};
constexpr std::size_t kReadPerTurn = 256 << 10;
constexpr int kAcceptsPerTurn = 64;
// A poll() that returns this much later than asked means the process was frozen.
constexpr std::chrono::milliseconds kPauseThreshold{1000};

std::atomic<std::int64_t> g_pause_end_ns{0};
std::atomic<std::int64_t> g_pause_ms{0};

std::int64_t now_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(Clock::now().time_since_epoch()).count();
}

bool same_token(const std::string& a, const std::string& b) {
  // Constant time in the content, so that timing does not reveal a prefix of the token.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

struct ProtocolError : std::runtime_error {
  using std::runtime_error::runtime_error;
};

// Parses a request out of a buffer that may hold only part of it: reads past
// the end mark the request incomplete (wait for more bytes); a length above
// its limit is a protocol error at once, before any of those bytes arrive.
class Reader {
 public:
  explicit Reader(const std::string& buf) : p_(buf.data()), n_(buf.size()) {}
  bool complete() const { return !short_; }
  std::size_t used() const { return pos_; }

  std::uint8_t u8() {
    unsigned char b[1] = {0};
    take(b, 1);
    return b[0];
  }
  std::uint32_t u32() {
    unsigned char b[4] = {0, 0, 0, 0};
    take(b, 4);
    return b[0] | (b[1] << 8) | (b[2] << 16) | (static_cast<std::uint32_t>(b[3]) << 24);
  }
  std::int64_t i64() {
    unsigned char b[8] = {};
    take(b, 8);
    std::uint64_t u = 0;
    for (int i = 7; i >= 0; --i) u = (u << 8) | b[i];
    return static_cast<std::int64_t>(u);
  }
  std::string str(std::size_t limit, const char* what) {
    const std::uint32_t len = u32();
    if (short_) return {};
    if (len > limit)
      throw ProtocolError(std::string(what) + " of " + std::to_string(len) + " bytes exceeds the limit of " +
                          std::to_string(limit));
    if (n_ - pos_ < len) {
      short_ = true;
      return {};
    }
    std::string s(p_ + pos_, len);
    pos_ += len;
    return s;
  }

 private:
  void take(unsigned char* out, std::size_t k) {
    if (short_ || n_ - pos_ < k) {
      short_ = true;
      return;
    }
    std::memcpy(out, p_ + pos_, k);
    pos_ += k;
  }

  const char* p_;
  std::size_t n_;
  std::size_t pos_ = 0;
  bool short_ = false;
};

int default_max_pending() {
  rlimit r{};
  if (::getrlimit(RLIMIT_NOFILE, &r) != 0 || r.rlim_cur == RLIM_INFINITY) return 128;
  return static_cast<int>(std::clamp<rlim_t>(r.rlim_cur / 8, 4, 128));
}

}  // namespace

std::chrono::milliseconds recent_pause(std::chrono::milliseconds within) {
  const std::int64_t end = g_pause_end_ns.load();
  if (end == 0 || (now_ns() - end) / 1000000 > within.count()) return std::chrono::milliseconds(0);
  return std::chrono::milliseconds(g_pause_ms.load());
}

struct StoreServer::Impl {
  struct Conn {
    Socket sock;
    std::uint64_t serial = 0;  // accept order: the oldest pending one is dropped first
    int rank = -1;             // -1 until admitted
    bool in_handshake = true;  // counted in `pending`
    Deadline handshake_deadline;
    std::string in;            // received, not parsed yet
    std::string out;           // reply being sent
    std::size_t out_sent = 0;
    bool closing = false;      // close once `out` is sent (a refusal)
    bool dead = false;         // close now
    bool waiting = false;      // a wait request is open
    std::vector<std::string> wait_keys;
    Deadline wait_deadline;
  };
  struct Task {
    TaskState state;
    std::string instance;  // the process that holds this rank, once one was admitted
    int open = 0;
  };

  Impl(std::string token_, int num_tasks, StoreLimits limits_, std::vector<std::string> names_)
      : token(std::move(token_)), limits(limits_), names(std::move(names_)), tasks(num_tasks) {
    if (limits.max_pending <= 0) limits.max_pending = default_max_pending();
    for (int r = static_cast<int>(names.size()); r < num_tasks; ++r) names.push_back("rank " + std::to_string(r));
  }

  const std::string token;
  StoreLimits limits;
  std::vector<std::string> names;
  Socket listener;
  Socket wake_read, wake_write;  // a byte here wakes the loop for shutdown
  std::atomic<bool> stopping{false};

  std::list<Conn> conns;
  std::uint64_t next_serial = 0;
  int pending = 0, admitted = 0;
  std::size_t buffered = 0;  // recounted every turn
  std::uint64_t dropped = 0;
  std::unordered_map<std::string, std::string> data;
  std::size_t stored_bytes = 0;
  std::vector<Task> tasks;
  int spare_fd = -1;        // given up to accept-and-close a connection when out of descriptors
  Deadline listen_paused{};  // after a failed accept, the listener rests until then

  ~Impl() {
    if (spare_fd >= 0) ::close(spare_fd);
  }

  void reserve_spare() {
    if (spare_fd < 0) spare_fd = ::open("/dev/null", O_RDONLY | O_CLOEXEC);
  }

  std::size_t max_request(const Conn& c) const {
    return c.rank < 0 ? kMaxHandshake : 1 + 4 + kMaxKey + 4 + limits.max_value + 64;
  }

  void drop(Conn& c) {
    if (!c.dead) ++dropped;
    c.dead = true;
  }

  void end_handshake(Conn& c) {
    if (c.in_handshake) --pending;
    c.in_handshake = false;
  }

  bool evict_oldest_pending() {
    Conn* oldest = nullptr;
    for (auto& c : conns)
      if (c.in_handshake && !c.dead && (!oldest || c.serial < oldest->serial)) oldest = &c;
    if (!oldest) return false;
    drop(*oldest);
    end_handshake(*oldest);
    oldest->sock = Socket();  // frees its descriptor now
    return true;
  }

  void accept_some() {
    for (int i = 0; i < kAcceptsPerTurn; ++i) {
      int err = 0;
      Socket s = accept_now(listener, &err);
      if (s.valid()) {
        if (pending >= limits.max_pending) evict_oldest_pending();
        conns.emplace_back();
        Conn& c = conns.back();
        c.sock = std::move(s);
        c.serial = next_serial++;
        c.handshake_deadline = after(limits.handshake_timeout);
        ++pending;
        continue;
      }
      if (err == EAGAIN || err == EWOULDBLOCK) return;
      if (err == EINTR || err == ECONNABORTED || err == EPROTO) continue;
      if (err == EMFILE || err == ENFILE || err == ENOBUFS || err == ENOMEM) {
        // Out of descriptors: make room by dropping the oldest stranger, else
        // accept-and-close the newcomer with the spare descriptor; otherwise
        // rest, so that a listener that stays readable cannot make us spin.
        if (evict_oldest_pending()) continue;
        if (spare_fd >= 0) {
          ::close(spare_fd);
          spare_fd = -1;
          int ignored = 0;
          Socket refused = accept_now(listener, &ignored);
          if (refused.valid()) ++dropped;
          refused = Socket();
          reserve_spare();
          if (spare_fd >= 0) continue;
        }
      }
      listen_paused = after(std::chrono::milliseconds(100));
      return;
    }
  }

  void admit(Conn& c, std::uint8_t verdict, const std::string& why) {
    Encoder reply;
    reply.u8(verdict).str(why);
    c.out.assign(reply.data().begin(), reply.data().end());
    c.out_sent = 0;
    if (verdict != kAdmitted) {
      c.closing = true;
      ++dropped;
    }
  }

  void handshake(Conn& c) {
    // Garbage is recognised from its first byte.
    for (std::size_t i = 0; i < std::min<std::size_t>(4, c.in.size()); ++i)
      if (c.in[i] != kMagic[i]) return drop(c);
    Reader r(c.in);
    for (int i = 0; i < 4; ++i) r.u8();
    const std::string presented = r.str(kMaxToken, "job token");
    const std::int64_t rank = r.i64();
    const std::string instance = r.str(kMaxInstance, "instance");
    if (!r.complete()) return;
    c.in.erase(0, r.used());
    end_handshake(c);
    const std::string& server = names[0];
    if (!same_token(presented, token)) return admit(c, kBadToken, "wrong job token");
    if (rank < 0 || rank >= static_cast<std::int64_t>(tasks.size()))
      return admit(c, kBadRank, "task rank " + std::to_string(rank) + " is outside this job's " +
                                    std::to_string(tasks.size()) + " tasks");
    Task& t = tasks[rank];
    const std::string& name = names[rank];
    if (!t.instance.empty() && t.instance != instance) {
      if (t.open > 0)
        return admit(c, kDuplicate,
                     name + " joined twice: it is already connected as " + t.instance + ", and " + instance +
                         " claims the same task index; start each task of TF_CONFIG's cluster exactly once, with its "
                         "own index");
      return admit(c, kStale,
                   name + " already took part in the job that " + server + " serves (as " + t.instance +
                       ", which has left); a restarted task cannot rejoin a running job: end every task of the job "
                       "and start them all again");
    }
    if (t.open >= limits.max_per_task)
      return admit(c, kBusy, name + " already has " + std::to_string(t.open) + " open connections to the store");
    t.instance = instance;
    ++t.open;
    t.state.connected = true;
    t.state.departed = false;
    c.rank = static_cast<int>(rank);
    ++admitted;
    admit(c, kAdmitted, "");
  }

  void finish_wait(Conn& c, bool force) {
    std::vector<const std::string*> missing;
    for (const auto& k : c.wait_keys)
      if (!data.count(k)) missing.push_back(&k);
    if (!missing.empty() && !force && Clock::now() < c.wait_deadline) return;
    Encoder reply;
    reply.u32(static_cast<std::uint32_t>(missing.size()));
    for (const auto* k : missing) reply.str(*k);
    c.out.assign(reply.data().begin(), reply.data().end());
    c.out_sent = 0;
    c.waiting = false;
    c.wait_keys.clear();
  }

  // One request of an admitted client; false when it is not complete yet.
  bool request(Conn& c) {
    Reader r(c.in);
    const std::uint8_t op = r.u8();
    Encoder reply;
    bool replies = true;
    if (op == kSet) {
      std::string key = r.str(kMaxKey, "key");
      std::string value = r.str(limits.max_value, "value");
      if (!r.complete()) return false;
      const auto it = data.find(key);
      const std::size_t old = it == data.end() ? 0 : it->first.size() + it->second.size();
      const std::size_t bytes = stored_bytes - old + key.size() + value.size();
      if ((it == data.end() && data.size() >= limits.max_keys) || bytes > limits.max_stored_bytes) {
        reply.u8(1).str("the rendezvous store is full (" + std::to_string(data.size()) + " keys, " +
                        std::to_string(stored_bytes) + " bytes)");
      } else {
        stored_bytes = bytes;
        if (it == data.end()) data.emplace(std::move(key), std::move(value));
        else it->second = std::move(value);
        reply.u8(0).str("");
        changed = true;
      }
    } else if (op == kGet) {
      const std::string key = r.str(kMaxKey, "key");
      if (!r.complete()) return false;
      const auto it = data.find(key);
      reply.u8(it != data.end() ? 1 : 0);
      if (it != data.end()) reply.str(it->second);
    } else if (op == kWait) {
      const std::uint32_t n = r.u32();
      if (r.complete() && n > kMaxWaitKeys) throw ProtocolError("a wait for " + std::to_string(n) + " keys");
      std::vector<std::string> keys;
      for (std::uint32_t i = 0; i < n && r.complete(); ++i) keys.push_back(r.str(kMaxKey, "key"));
      const std::int64_t ms = r.i64();
      if (!r.complete()) return false;
      c.waiting = true;
      c.wait_keys = std::move(keys);
      c.wait_deadline = after(std::chrono::milliseconds(std::max<std::int64_t>(0, ms)));
      replies = false;
    } else if (op == kProgress) {
      const std::int64_t seq = r.i64();
      if (!r.complete()) return false;
      auto& p = tasks[c.rank].state.progress;
      p = std::max(p, seq);
      replies = false;
    } else if (op == kStatus) {
      if (!r.complete()) return false;
      reply.u32(static_cast<std::uint32_t>(tasks.size()));
      for (const auto& t : tasks) reply.u8(t.state.connected).u8(t.state.departed).i64(t.state.progress);
    } else {
      if (!r.complete()) return false;
      throw ProtocolError("unknown request");
    }
    c.in.erase(0, r.used());
    if (replies) {
      c.out.assign(reply.data().begin(), reply.data().end());
      c.out_sent = 0;
    }
    if (c.waiting) finish_wait(c, false);
    return true;
  }

  void process(Conn& c) {
    while (!c.dead && !c.closing && !c.waiting && c.out_sent == c.out.size() && !c.in.empty()) {
      if (c.rank < 0) {
        handshake(c);
        if (c.rank < 0) break;  // incomplete, refused or dropped
      } else if (!request(c)) {
        break;
      }
      flush(c);
    }
    if (!c.dead && c.in.size() > max_request(c)) drop(c);
  }

  void flush(Conn& c) {
    while (!c.dead && c.out_sent < c.out.size()) {
      const ssize_t w =
          ::send(c.sock.fd(), c.out.data() + c.out_sent, c.out.size() - c.out_sent, MSG_NOSIGNAL | MSG_DONTWAIT);
      if (w < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
        return;
      }
      c.out_sent += static_cast<std::size_t>(w);
    }
    if (c.out_sent == c.out.size()) {
      c.out.clear();
      c.out_sent = 0;
      if (c.closing) c.dead = true;
    }
  }

  void receive(Conn& c) {
    char buf[64 << 10];
    std::size_t got = 0;
    while (!c.dead && got < kReadPerTurn) {
      const ssize_t r = ::recv(c.sock.fd(), buf, sizeof(buf), MSG_DONTWAIT);
      if (r == 0) {
        c.dead = true;  // the peer left
        return;
      }
      if (r < 0) {
        if (errno == EINTR) continue;
        if (errno != EAGAIN && errno != EWOULDBLOCK) c.dead = true;
        return;
      }
      got += static_cast<std::size_t>(r);
      // Memory grows only with bytes that arrived, and only up to the limits.
      if (c.in.size() + static_cast<std::size_t>(r) > max_request(c) ||
          buffered + static_cast<std::size_t>(r) > limits.max_buffered_bytes) {
        return drop(c);
      }
      c.in.append(buf, static_cast<std::size_t>(r));
      buffered += static_cast<std::size_t>(r);
    }
  }

  void close(Conn& c) {
    if (c.rank >= 0) {
      Task& t = tasks[c.rank];
      if (--t.open == 0) {
        t.state.connected = false;
        t.state.departed = true;
      }
      --admitted;
    }
    end_handshake(c);
  }

  // Runs one step of a connection's work; a connection that breaks the
  // protocol or a limit (or whose request cannot be allocated) is dropped.
  template <typename Fn>
  void guarded(Conn& c, Fn&& fn) {
    try {
      fn();
    } catch (const std::exception&) {
      drop(c);
    }
  }

  bool changed = false;  // a set happened: open waits may be complete
};

StoreServer::StoreServer(const std::string& host, int port, std::string token, int num_tasks, StoreLimits limits,
                         std::vector<std::string> task_names)
    : impl_(std::make_unique<Impl>(std::move(token), num_tasks, limits, std::move(task_names))) {
  if (num_tasks < 1) throw std::invalid_argument("num_tasks must be >= 1, got " + std::to_string(num_tasks));
  impl_->listener = listen_on(host, port, &port_);
  int fds[2];
  if (::pipe2(fds, O_CLOEXEC | O_NONBLOCK) != 0)
    throw PeerLost(std::string("cannot start the rendezvous store: pipe: ") + std::strerror(errno));
  impl_->wake_read = Socket(fds[0]);
  impl_->wake_write = Socket(fds[1]);
  impl_->reserve_spare();
  try {
    thread_ = std::thread([this] { loop(); });
  } catch (const std::system_error& e) {
    throw PeerLost(std::string("cannot start the rendezvous store's thread: ") + e.what() +
                   " (is the process at its thread or memory limit?)");
  }
}

StoreServer::~StoreServer() {
  impl_->stopping = true;
  const char byte = 1;
  while (::write(impl_->wake_write.fd(), &byte, 1) < 0 && errno == EINTR) {
  }
  thread_.join();
}

StoreServer::Stats StoreServer::stats() const {
  std::lock_guard<std::mutex> lock(stats_mu_);
  return stats_;
}

void StoreServer::loop() {
  Impl& s = *impl_;
  std::vector<pollfd> fds;
  std::vector<Impl::Conn*> polled;
  while (!s.stopping) {
    try {
      const Deadline now = Clock::now();
      // Expire handshakes and waits; find the next moment something is due.
      Deadline next = now + kTick;
      for (auto& c : s.conns) {
        if (c.dead) continue;
        if (c.in_handshake) {
          if (now >= c.handshake_deadline) s.drop(c);
          else next = std::min(next, c.handshake_deadline);
        }
        if (c.waiting) {
          if (s.changed || now >= c.wait_deadline) s.guarded(c, [&] {
            s.finish_wait(c, false);
            s.flush(c);
            s.process(c);
          });
          if (c.waiting) next = std::min(next, c.wait_deadline);
        }
      }
      s.changed = false;
      s.buffered = 0;
      for (auto it = s.conns.begin(); it != s.conns.end();) {
        if (it->dead) {
          s.close(*it);
          it = s.conns.erase(it);
        } else {
          s.buffered += it->in.size() + it->out.size();
          ++it;
        }
      }
      {
        std::lock_guard<std::mutex> lock(stats_mu_);
        stats_ = Stats{s.admitted, s.pending, s.data.size(), s.stored_bytes, s.buffered, s.dropped};
      }

      fds.clear();
      polled.clear();
      fds.push_back({s.wake_read.fd(), POLLIN, 0});
      const bool listening = now >= s.listen_paused;
      fds.push_back({listening ? s.listener.fd() : -1, POLLIN, 0});
      if (!listening) next = std::min(next, s.listen_paused);
      for (auto& c : s.conns) {
        short events = POLLIN;
        if (c.out_sent < c.out.size()) events |= POLLOUT;
        fds.push_back({c.sock.fd(), events, 0});
        polled.push_back(&c);
      }
      const auto wait_ms = std::chrono::duration_cast<std::chrono::milliseconds>(next - now);
      const int timeout = static_cast<int>(std::max<long long>(0, wait_ms.count()) + 1);
      const Deadline before = Clock::now();
      const int ready = ::poll(fds.data(), fds.size(), timeout);
      const Deadline woke = Clock::now();
      const auto overslept =
          std::chrono::duration_cast<std::chrono::milliseconds>(woke - before) - std::chrono::milliseconds(timeout);
      if (overslept > kPauseThreshold) {
        g_pause_ms = overslept.count();
        g_pause_end_ns = now_ns();
      }
      if (ready < 0) {
        if (errno != EINTR) std::this_thread::sleep_for(std::chrono::milliseconds(10));
        continue;
      }
      if (fds[0].revents) {
        char buf[64];
        while (::read(s.wake_read.fd(), buf, sizeof(buf)) > 0) {
        }
      }
      if (s.stopping) break;
      if (listening && fds[1].revents) s.accept_some();
      for (std::size_t i = 0; i < polled.size(); ++i) {
        Impl::Conn& c = *polled[i];
        const short ev = fds[i + 2].revents;
        if (!ev || c.dead) continue;
        s.guarded(c, [&] {
          if (ev & POLLOUT) s.flush(c);
          if (ev & (POLLIN | POLLHUP | POLLERR)) s.receive(c);
          s.process(c);
        });
      }
    } catch (...) {
      // Never let the store's thread die (that would end the process):
      // whatever failed, e.g. an allocation, is retried on the next turn.
      std::this_thread::sleep_for(std::chrono::milliseconds(10));
    }
  }
  s.conns.clear();
}

std::string StoreClient::process_instance() {
  static const std::string base = [] {
    char host[256] = {};
    ::gethostname(host, sizeof(host) - 1);
    std::random_device rd;
    char tag[32];
    std::snprintf(tag, sizeof(tag), "%08x", rd());
    return std::string(host) + "#" + tag;
  }();
  // The pid is read each time: a forked child is another process.
  return "process " + std::to_string(::getpid()) + " on " + base;
}

StoreClient::StoreClient(const std::string& host, int port, const std::string& token, int rank,
                         std::string server_task, std::chrono::milliseconds timeout, const WaitCallback& on_wait,
                         std::string instance)
    : where_(server_task + " at " + host + ":" + std::to_string(port)),
      server_task_(std::move(server_task)),
      token_(token),
      rank_(rank),
      timeout_(timeout) {
  if (instance.empty()) instance = process_instance();
  const Deadline started = Clock::now();
  const Deadline deadline = after(timeout);
  Deadline next_report = after(std::chrono::milliseconds(1000));
  std::string error = "not tried";
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    // One attempt waits a few seconds at most, so that a store that is
    // frozen (not refusing) still lets on_wait report the wait.
    const Deadline attempt = std::min(deadline, after(std::chrono::milliseconds(3000)));
    Socket s = try_connect(host, port, attempt, &error);
    if (s.valid()) {
      try {
        std::vector<char> msg(kMagic, kMagic + 4);
        Encoder body;
        body.str(token).i64(rank).str(instance.substr(0, kMaxInstance));
        msg.insert(msg.end(), body.data().begin(), body.data().end());
        s.write_all(msg.data(), msg.size(), attempt);
        Decoder d{s, attempt};
        const std::uint8_t verdict = d.u8();
        const std::string why = d.str(kMaxKey);
        if (verdict != kAdmitted)
          throw Refused("the rendezvous store of " + where_ + " refused this task: " + why +
                        (verdict == kBadToken ? " (every task of a job must see the same TF_CONFIG cluster, or the "
                                                "same MIRRORED_JOB_TOKEN)"
                                              : ""));
        sock_ = std::move(s);
        return;
      } catch (const Refused&) {
        throw;
      } catch (const std::exception& e) {
        error = e.what();  // the server is starting, restarting or frozen: try again
      }
    }
    const Deadline now = Clock::now();
    if (now + backoff >= deadline)
      throw PeerTimeout("could not reach the rendezvous store of " + where_ + " within " + seconds(timeout) +
                        " (last error: " + error + "); start task " + server_task_ +
                        ", check its address in TF_CONFIG, or raise CommunicationOptions.timeout_seconds");
    if (on_wait && now >= next_report) {
      on_wait(std::chrono::duration_cast<std::chrono::milliseconds>(now - started));
      next_report = after(std::chrono::milliseconds(1000));
    }
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

template <typename Fn>
auto StoreClient::call(const char* what, Fn&& fn) -> decltype(fn()) {
  std::lock_guard<std::mutex> lock(mu_);
  const std::string server = "task " + server_task_ + " (which serves the rendezvous store at " +
                             where_.substr(server_task_.size() + 4) + ")";
  if (!sock_.valid()) {
    if (timed_out_)
      throw PeerTimeout(std::string("rendezvous store ") + what + ": " + server +
                        " stopped answering earlier: it is stopped (e.g. SIGSTOP), hung or overloaded");
    throw PeerLost(std::string("rendezvous store ") + what + ": the connection to " + where_ +
                   " broke earlier; task " + server_task_ + " is gone");
  }
  try {
    return fn();
  } catch (const Refused&) {
    throw;  // a whole reply was read: the stream is intact
  } catch (const PeerTimeout& e) {
    // A request cut in half leaves the stream unusable: drop it.
    sock_ = Socket();
    timed_out_ = true;
    throw PeerTimeout(std::string("rendezvous store ") + what + ": " + server + " did not answer within " +
                      seconds(timeout_) + ": it is stopped (e.g. SIGSTOP), hung or overloaded");
  } catch (const std::exception& e) {
    sock_ = Socket();
    throw PeerLost(std::string("rendezvous store ") + what + " failed: " + e.what() + "; task " + server_task_ +
                   " (which serves the store at " + where_ + ") is gone or unreachable");
  }
}

void StoreClient::set(const std::string& key, const std::vector<char>& value) {
  // Refused here rather than by a server that would drop the connection.
  const std::size_t limit = StoreLimits{}.max_value;
  if (value.size() > limit || key.size() > kMaxKey)
    throw std::invalid_argument("rendezvous store set '" + key.substr(0, 64) + "': a key of " +
                                std::to_string(key.size()) + " bytes or a value of " + std::to_string(value.size()) +
                                " bytes exceeds the store's limits (" + std::to_string(kMaxKey) + ", " +
                                std::to_string(limit) + ")");
  std::string refusal;
  call("set", [&] {
    Encoder e;
    e.u8(kSet).str(key).bytes(value.data(), value.size());
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    Decoder d{sock_, after(timeout_)};
    if (d.u8() != 0) refusal = d.str(kMaxKey);
    else d.str(kMaxKey);
    return 0;
  });
  if (!refusal.empty()) throw Refused("rendezvous store set '" + key + "': " + refusal);
}

std::vector<char> StoreClient::get(const std::string& key) {
  bool found = false;
  auto value = call("get", [&] {
    Encoder e;
    e.u8(kGet).str(key);
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    Decoder d{sock_, after(timeout_)};
    found = d.u8() != 0;
    return found ? d.bytes(kMaxReplyValue) : std::vector<char>();
  });
  if (!found) throw std::out_of_range("rendezvous store: key '" + key + "' is not set");
  return value;
}

std::vector<std::string> StoreClient::wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout) {
  return call("wait", [&] {
    Encoder e;
    e.u8(kWait).u32(static_cast<std::uint32_t>(keys.size()));
    for (const auto& k : keys) e.str(k);
    e.i64(timeout.count());
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    // The server answers at `timeout`; allow the usual reply time on top (saturating).
    const auto t = std::max(timeout, std::chrono::milliseconds(0));
    const auto reply = std::max(timeout_, std::chrono::milliseconds(0));
    Decoder d{sock_, after(reply > std::chrono::milliseconds::max() - t ? std::chrono::milliseconds::max() : t + reply)};
    std::vector<std::string> missing(d.u32());
    for (auto& k : missing) k = d.str(kMaxKey);
    return missing;
  });
}

void StoreClient::progress(std::int64_t seq) {
  call("progress", [&] {
    Encoder e;
    e.u8(kProgress).i64(seq);
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    return 0;
  });
}

std::vector<TaskState> StoreClient::status() {
  return call("status", [&] {
    Encoder e;
    e.u8(kStatus);
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    Decoder d{sock_, after(timeout_)};
    std::vector<TaskState> tasks(d.u32());
    for (auto& t : tasks) {
      t.connected = d.u8() != 0;
      t.departed = d.u8() != 0;
      t.progress = d.i64();
    }
    return tasks;
  });
}

}  // namespace mirrored::net
