// The rendezvous key-value store of a multi-worker job. The chief (or worker
// 0) serves it at its TF_CONFIG address; every task, the chief included,
// talks to it through one StoreClient. Besides set/get/wait (Gloo's Store
// contract) it keeps, per task, whether its connection is open and which
// collective it last started, so that a failed collective can name the task
// that died or fell behind.
#pragma once

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <list>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <vector>

#include "net/socket.h"

namespace mirrored::net {

struct TaskState {
  bool connected = false;  // has an open connection to the store now
  bool departed = false;   // connected once, and every connection has since closed
  std::int64_t progress = -1;  // sequence number of the last collective it started
};

class StoreServer {
 public:
  // Listens on exactly host:port (port 0 picks a free one) and admits clients
  // that present `token` and a rank in [0, num_tasks).
  StoreServer(const std::string& host, int port, std::string token, int num_tasks);
  ~StoreServer();
  StoreServer(const StoreServer&) = delete;
  StoreServer& operator=(const StoreServer&) = delete;

  int port() const { return port_; }

 private:
  struct Connection {
    Socket sock;
    std::thread thread;
    std::atomic<bool> done{false};
  };

  void accept_loop();
  void serve(Connection* c);
  int handshake(Connection* c);  // the admitted rank, or -1
  void handle_wait(Connection* c);
  void reap(bool all);

  const std::string token_;
  const int num_tasks_;
  Socket listener_;
  int port_ = 0;
  std::atomic<bool> stopping_{false};

  std::mutex mu_;
  std::condition_variable changed_;
  std::unordered_map<std::string, std::vector<char>> data_;
  std::vector<TaskState> tasks_;
  std::vector<int> open_connections_;

  std::list<Connection> connections_;  // touched by the acceptor thread and the destructor only
  std::thread acceptor_;
};

class StoreClient {
 public:
  // Connects to the store of `server_task` (e.g. "chief:0") at host:port,
  // retrying until `timeout`, and presents `token` and this task's rank.
  StoreClient(const std::string& host, int port, const std::string& token, int rank, std::string server_task,
              std::chrono::milliseconds timeout);

  void set(const std::string& key, const std::vector<char>& value);
  // The value of a key that is present (wait() for it first); an absent key throws std::out_of_range.
  std::vector<char> get(const std::string& key);
  // Waits until every key is present or `timeout` passes; returns the keys still missing.
  std::vector<std::string> wait(const std::vector<std::string>& keys, std::chrono::milliseconds timeout);
  // Records that this task starts collective `seq`; sent without waiting for a reply.
  void progress(std::int64_t seq);
  std::vector<TaskState> status();

  int rank() const { return rank_; }
  const std::string& server_task() const { return server_task_; }
  std::chrono::milliseconds timeout() const { return timeout_; }

 private:
  template <typename Fn>
  auto call(const char* what, Fn&& fn) -> decltype(fn());

  const std::string where_;  // "chief:0 at host:port", for messages
  const std::string server_task_;
  const int rank_;
  const std::chrono::milliseconds timeout_;
  std::mutex mu_;  // one request on the wire at a time
  Socket sock_;
};

}  // namespace mirrored::net
