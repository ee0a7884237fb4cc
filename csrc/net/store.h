// The rendezvous key-value store of a multi-worker job. The chief (or worker
// 0) serves it at its TF_CONFIG address; every task, the chief included,
// talks to it through one StoreClient. Besides set/get/wait (Gloo's Store
// contract) it keeps, per task, whether its connection is open and which
// collective it last started, so that a failed collective can name the task
// that died or fell behind.
//
// The server is one thread running a poll() loop, so that whatever other
// local processes do (connection floods, garbage, huge announced sizes, a
// descriptor limit) costs bounded memory and CPU and never ends the job.
#pragma once

#include <chrono>
#include <cstdint>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

#include "net/socket.h"

namespace mirrored::net {

struct TaskState {
  bool connected = false;  // has an open connection to the store now
  bool departed = false;   // connected once, and every connection has since closed
  std::int64_t progress = -1;  // sequence number of the last collective it started
};

// Bounds of everything a peer can make the server hold. A real job stays far
// below them (a few keys of a few hundred bytes per task and strategy).
struct StoreLimits {
  // Connections that have not finished the handshake; when full, the oldest
  // is dropped for a newcomer, so a flood cannot lock the job's tasks out.
  // 0: an eighth of this process's descriptor limit, between 4 and 128.
  int max_pending = 0;
  int max_per_task = 16;  // open connections of one admitted task
  std::size_t max_value = std::size_t{4} << 20;
  std::size_t max_keys = std::size_t{1} << 18;
  std::size_t max_stored_bytes = std::size_t{128} << 20;    // keys and values together
  std::size_t max_buffered_bytes = std::size_t{64} << 20;   // unparsed requests and unsent replies, all connections
  std::chrono::milliseconds handshake_timeout{5000};        // to present the job token after connecting
};

class StoreServer {
 public:
  // Listens on exactly host:port (port 0 picks a free one) and admits clients
  // that present `token` and a rank in [0, num_tasks), one process per rank.
  // `task_names` (e.g. "chief:0", "worker:0"; default "rank 0", ...) name the
  // ranks in refusals.
  StoreServer(const std::string& host, int port, std::string token, int num_tasks, StoreLimits limits = {},
              std::vector<std::string> task_names = {});
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

  struct Stats {
    int admitted = 0;  // open connections of the job's tasks
    int pending = 0;   // open connections still in the handshake
    std::size_t keys = 0, stored_bytes = 0, buffered_bytes = 0;
    std::uint64_t dropped = 0;  // connections closed for breaking the protocol or a limit
  };
  // A snapshot, updated by the server thread on every turn of its loop.
  Stats stats() const;

 private:
  struct Impl;
  void loop();

  int port_ = 0;
  std::unique_ptr<Impl> impl_;
  mutable std::mutex stats_mu_;
  Stats stats_;
  std::thread thread_;
};

// How long this process was recently frozen (SIGSTOP, or a stalled machine),
// as seen by a store server running in it: the longest gap between turns of
// its loop that ended less than `within` ago; zero when none (or no server).
std::chrono::milliseconds recent_pause(std::chrono::milliseconds within);

class StoreClient {
 public:
  // Called about once a second, with the time waited so far, while the store
  // is not reachable yet; it may throw to stop waiting.
  using WaitCallback = std::function<void(std::chrono::milliseconds waited)>;

  // Connects to the store of `server_task` (e.g. "chief:0") at host:port,
  // retrying until `timeout`, and presents `token` and this task's rank.
  // `instance` tells this process from another claiming the same rank
  // (default: host name, pid and a per-process random number).
  StoreClient(const std::string& host, int port, const std::string& token, int rank, std::string server_task,
              std::chrono::milliseconds timeout, const WaitCallback& on_wait = {}, std::string instance = {});

  void set(const std::string& key, const std::vector<char>& value);
  // The value of a key that is present (wait() for it first); an absent key throws std::out_of_range.
  std::vector<char> get(const std::string& key);
  // Waits until every key is present or `timeout` passes; returns the keys still missing.
  std::vector<std::string> wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Records that this task starts collective `seq`; sent without waiting for a reply.
  void progress(std::int64_t seq);
  std::vector<TaskState> status();

  int rank() const { return rank_; }
  // The job token this task presented: the key of every other proof (Gloo mesh, shared segment).
  const std::string& token() const { return token_; }
  const std::string& server_task() const { return server_task_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

  // This process's default instance identity.
  static std::string process_instance();

 private:
  template <typename Fn>
  auto call(const char* what, Fn&& fn) -> decltype(fn());

  const std::string where_;  // "chief:0 at host:port", for messages
  const std::string server_task_;
  const std::string token_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // one request on the wire at a time
  Socket sock_;
  bool timed_out_ = false;  // the connection was dropped because the server stopped answering
};

}  // namespace mirrored::net
