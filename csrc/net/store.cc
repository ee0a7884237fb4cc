#include "net/store.h"

#include <algorithm>
#include <cstdio>

#include "net/errors.h"

namespace mirrored::net {
namespace {

// Wire format (little-endian, see Encoder): a handshake, then requests that
// each start with an opcode. Every request but kProgress gets a reply.
constexpr char kMagic[4] = {'M', 'R', 'V', '1'};
enum Op : std::uint8_t { kSet = 1, kGet = 2, kWait = 3, kProgress = 4, kStatus = 5 };
enum Admission : std::uint8_t { kAdmitted = 0, kBadToken = 1, kBadRank = 2 };

constexpr std::size_t kMaxToken = 1024;
constexpr std::size_t kMaxKey = 4096;
constexpr std::size_t kMaxValue = std::size_t{64} << 20;
constexpr std::uint32_t kMaxKeys = 1 << 16;
// A stranger that connects and says nothing must not hold a thread for long.
constexpr std::chrono::milliseconds kHandshakeTimeout{10000};
constexpr std::chrono::milliseconds kReplyTimeout{10000};

bool same_token(const std::string& a, const std::string& b) {
  // Constant time in the content, so that timing does not reveal a prefix of the token.
  if (a.size() != b.size()) return false;
  unsigned char diff = 0;
  for (std::size_t i = 0; i < a.size(); ++i) diff |= static_cast<unsigned char>(a[i] ^ b[i]);
  return diff == 0;
}

std::string seconds(std::chrono::milliseconds ms) {
  const double s = static_cast<double>(ms.count()) / 1000.0;
  char buf[32];
  std::snprintf(buf, sizeof(buf), "%g s", s);
  return buf;
}

}  // namespace

StoreServer::StoreServer(const std::string& host, int port, std::string token, int num_tasks)
    : token_(std::move(token)), num_tasks_(num_tasks), tasks_(num_tasks), open_connections_(num_tasks, 0) {
  listener_ = listen_on(host, port, &port_);
  acceptor_ = std::thread([this] { accept_loop(); });
}

StoreServer::~StoreServer() {
  stopping_ = true;
  acceptor_.join();
  for (auto& c : connections_) c.sock.shutdown();
  {
    std::lock_guard<std::mutex> lock(mu_);
    changed_.notify_all();
  }
  reap(true);
}

void StoreServer::accept_loop() {
  while (!stopping_) {
    // A short poll so that shutdown is noticed promptly without a wake-up pipe.
    Socket s = accept_for(listener_, std::chrono::milliseconds(100));
    reap(false);
    if (!s.valid()) continue;
    connections_.emplace_back();
    Connection* c = &connections_.back();
    c->sock = std::move(s);
    c->thread = std::thread([this, c] { serve(c); });
  }
}

void StoreServer::reap(bool all) {
  for (auto it = connections_.begin(); it != connections_.end();) {
    if (all || it->done) {
      it->thread.join();
      it = connections_.erase(it);
    } else {
      ++it;
    }
  }
}

int StoreServer::handshake(Connection* c) {
  Decoder d{c->sock, after(kHandshakeTimeout)};
  char magic[4];
  c->sock.read_exact(magic, 4, d.deadline);
  if (!std::equal(magic, magic + 4, kMagic)) return -1;  // not our protocol: drop silently
  const std::string token = d.str(kMaxToken);
  const std::int64_t rank = d.i64();
  Encoder reply;
  if (!same_token(token, token_)) {
    reply.u8(kBadToken).str("wrong job token");
  } else if (rank < 0 || rank >= num_tasks_) {
    reply.u8(kBadRank).str("task rank " + std::to_string(rank) + " is outside this job's " +
                           std::to_string(num_tasks_) + " tasks");
  } else {
    reply.u8(kAdmitted).str("");
  }
  c->sock.write_all(reply.data().data(), reply.data().size(), after(kReplyTimeout));
  return reply.data()[0] == kAdmitted ? static_cast<int>(rank) : -1;
}

void StoreServer::handle_wait(Connection* c) {
  Decoder d{c->sock, after(kReplyTimeout)};
  const std::uint32_t n = d.u32();
  if (n > kMaxKeys) throw PeerLost("protocol error: too many keys");
  std::vector<std::string> keys(n);
  for (auto& k : keys) k = d.str(kMaxKey);
  const Deadline deadline = after(std::chrono::milliseconds(std::max<std::int64_t>(0, d.i64())));

  std::vector<std::string> missing;
  std::unique_lock<std::mutex> lock(mu_);
  for (;;) {
    missing.clear();
    for (const auto& k : keys)
      if (!data_.count(k)) missing.push_back(k);
    if (missing.empty() || stopping_ || Clock::now() >= deadline) break;
    // Wake up now and then to notice a waiter that went away.
    changed_.wait_until(lock, std::min(deadline, after(std::chrono::milliseconds(100))));
    if (c->sock.peer_closed()) throw PeerLost("waiter left");
  }
  lock.unlock();
  Encoder reply;
  reply.u32(static_cast<std::uint32_t>(missing.size()));
  for (const auto& k : missing) reply.str(k);
  c->sock.write_all(reply.data().data(), reply.data().size(), after(kReplyTimeout));
}

void StoreServer::serve(Connection* c) {
  int rank = -1;
  try {
    rank = handshake(c);
    if (rank >= 0) {
      {
        std::lock_guard<std::mutex> lock(mu_);
        tasks_[rank].connected = true;
        ++open_connections_[rank];
      }
      for (;;) {
        // Between requests a client may stay silent for as long as it likes.
        Decoder d{c->sock, never()};
        const std::uint8_t op = d.u8();
        d.deadline = after(kReplyTimeout);
        Encoder reply;
        if (op == kSet) {
          std::string key = d.str(kMaxKey);
          std::vector<char> value = d.bytes(kMaxValue);
          std::lock_guard<std::mutex> lock(mu_);
          data_[std::move(key)] = std::move(value);
          changed_.notify_all();
          reply.u8(0);
        } else if (op == kGet) {
          const std::string key = d.str(kMaxKey);
          std::lock_guard<std::mutex> lock(mu_);
          const auto it = data_.find(key);
          reply.u8(it != data_.end() ? 1 : 0);
          if (it != data_.end()) reply.bytes(it->second.data(), it->second.size());
        } else if (op == kWait) {
          handle_wait(c);
          continue;
        } else if (op == kProgress) {
          const std::int64_t seq = d.i64();
          std::lock_guard<std::mutex> lock(mu_);
          tasks_[rank].progress = std::max(tasks_[rank].progress, seq);
          continue;
        } else if (op == kStatus) {
          std::lock_guard<std::mutex> lock(mu_);
          reply.u32(static_cast<std::uint32_t>(tasks_.size()));
          for (const auto& t : tasks_) reply.u8(t.connected).u8(t.departed).i64(t.progress);
        } else {
          break;  // unknown request: the client speaks another protocol
        }
        c->sock.write_all(reply.data().data(), reply.data().size(), after(kReplyTimeout));
      }
    }
  } catch (const std::exception&) {
    // The client left or broke the protocol; either way this connection is over.
  }
  if (rank >= 0) {
    std::lock_guard<std::mutex> lock(mu_);
    if (--open_connections_[rank] == 0) {
      tasks_[rank].connected = false;
      tasks_[rank].departed = true;
    }
    changed_.notify_all();
  }
  c->done = true;
}

StoreClient::StoreClient(const std::string& host, int port, const std::string& token, int rank,
                         std::string server_task, std::chrono::milliseconds timeout)
    : where_(server_task + " at " + host + ":" + std::to_string(port)),
      server_task_(std::move(server_task)),
      rank_(rank),
      timeout_(timeout) {
  const Deadline deadline = after(timeout);
  std::string error = "not tried";
  auto backoff = std::chrono::milliseconds(20);
  for (;;) {
    Socket s = try_connect(host, port, deadline, &error);
    if (s.valid()) {
      try {
        std::vector<char> msg(kMagic, kMagic + 4);
        Encoder body;
        body.str(token).i64(rank);
        msg.insert(msg.end(), body.data().begin(), body.data().end());
        s.write_all(msg.data(), msg.size(), deadline);
        Decoder d{s, deadline};
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
        error = e.what();  // the server is starting or restarting: try again
      }
    }
    if (Clock::now() + backoff >= deadline)
      throw PeerTimeout("could not reach the rendezvous store of " + where_ + " within " + seconds(timeout) +
                        " (last error: " + error + "); start task " + server_task_ +
                        ", check its address in TF_CONFIG, or raise CommunicationOptions.timeout_seconds");
    std::this_thread::sleep_for(backoff);
    backoff = std::min(backoff * 2, std::chrono::milliseconds(500));
  }
}

template <typename Fn>
auto StoreClient::call(const char* what, Fn&& fn) -> decltype(fn()) {
  std::lock_guard<std::mutex> lock(mu_);
  if (!sock_.valid())
    throw PeerLost(std::string("rendezvous store ") + what + ": the connection to " + where_ +
                   " broke earlier; task " + server_task_ + " is gone");
  try {
    return fn();
  } catch (const std::exception& e) {
    // A request cut in half leaves the stream unusable: drop it.
    sock_ = Socket();
    throw PeerLost(std::string("rendezvous store ") + what + " failed: " + e.what() + "; task " + server_task_ +
                   " (which serves the store at " + where_ + ") is gone or unreachable");
  }
}

void StoreClient::set(const std::string& key, const std::vector<char>& value) {
  call("set", [&] {
    Encoder e;
    e.u8(kSet).str(key).bytes(value.data(), value.size());
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    Decoder{sock_, after(timeout_)}.u8();
    return 0;
  });
}

std::vector<char> StoreClient::get(const std::string& key) {
  bool found = false;
  auto value = call("get", [&] {
    Encoder e;
    e.u8(kGet).str(key);
    sock_.write_all(e.data().data(), e.data().size(), after(timeout_));
    Decoder d{sock_, after(timeout_)};
    found = d.u8() != 0;
    return found ? d.bytes(kMaxValue) : std::vector<char>();
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
    Decoder d{sock_, after(timeout + timeout_)};
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
