// The rendezvous store and the Gloo communicator in C++, with the processes
// of a job played by threads (what the sanitizer builds exercise): results
// against a reference, admission, and the naming of dead and late peers.
#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include <sys/socket.h>
#include <unistd.h>

#include "check.h"
#include "net/errors.h"
#include "net/gloo_communicator.h"
#include "net/hmac.h"
#include "net/socket.h"

using namespace mirrored;
using namespace mirrored::net;
using std::chrono::milliseconds;

namespace {

const std::vector<std::string> kTasks{"chief:0", "worker:0", "worker:1"};

// Runs body(rank, communicator) on one thread per task of a fresh job.
void job(int n, milliseconds timeout, const std::string& scope,
         const std::function<void(int, GlooCommunicator&)>& body) {
  StoreServer server("127.0.0.1", 0, "token", static_cast<int>(kTasks.size()));
  std::vector<std::thread> threads;
  for (int rank = 0; rank < static_cast<int>(kTasks.size()); ++rank)
    threads.emplace_back([&, rank] {
      auto store = std::make_shared<StoreClient>("127.0.0.1", server.port(), "token", rank, kTasks[0],
                                                 milliseconds(10000));
      GlooCommunicator comm(store, kTasks, n, "127.0.0.1", timeout, scope);
      body(rank, comm);
    });
  for (auto& t : threads) t.join();
}

float value(int replica, std::size_t i) { return static_cast<float>((i * 5 + replica * 3) % 7) - 3.0f; }

}  // namespace

TEST(store_set_wait_get_and_admission) {
  StoreServer server("127.0.0.1", 0, "secret", 2);
  StoreClient a("127.0.0.1", server.port(), "secret", 0, "chief:0", milliseconds(5000));
  StoreClient b("127.0.0.1", server.port(), "secret", 1, "chief:0", milliseconds(5000));
  a.set("k", {'x', 'y'});
  CHECK(b.wait({"k"}, milliseconds(1000)).empty());
  CHECK((b.get("k") == std::vector<char>{'x', 'y'}));
  const auto missing = b.wait({"k", "absent"}, milliseconds(100));
  CHECK(missing.size() == 1 && missing[0] == "absent");
  const auto states = a.status();
  CHECK(states.size() == 2 && states[0].connected && states[1].connected && !states[1].departed);
  bool refused = false;
  try {
    StoreClient stranger("127.0.0.1", server.port(), "guess", 1, "chief:0", milliseconds(2000));
  } catch (const Refused& e) {
    refused = std::strstr(e.what(), "wrong job token") != nullptr;
  }
  CHECK(refused);
}

TEST(collectives_match_the_reference) {
  constexpr int n = 2;  // local replicas per task; 6 replicas in the job
  constexpr int replicas = 3 * n;
  job(n, milliseconds(10000), "collectives", [](int rank, GlooCommunicator& comm) {
    for (std::size_t count : {std::size_t{1}, std::size_t{5}, std::size_t{300001}}) {  // one element, one chunk, several chunks
      for (Algorithm algorithm : {Algorithm::kAuto, Algorithm::kRing, Algorithm::kTree}) {
        std::vector<std::vector<float>> in(n, std::vector<float>(count)), out = in;
        for (int j = 0; j < n; ++j)
          for (std::size_t i = 0; i < count; ++i) in[j][i] = value(rank * n + j, i);
        const void* ins[n] = {in[0].data(), in[1].data()};
        void* outs[n] = {out[0].data(), out[1].data()};
        comm.all_reduce(n, ins, outs, count, DType::kFloat32, ReduceOp::kMean, algorithm);
        for (std::size_t i = 0; i < count; i += (count < 997 ? 1 : 997)) {
          float want = 0;
          for (int r = 0; r < replicas; ++r) want += value(r, i);
          CHECK(out[0][i] == want / replicas && out[1][i] == want / replicas);
        }
      }
    }
    std::int32_t mine[n][3], got[n][3];
    for (int j = 0; j < n; ++j)
      for (int i = 0; i < 3; ++i) mine[j][i] = (rank * n + j) * 10 + i;
    const void* ins[n] = {mine[0], mine[1]};
    void* outs[n] = {got[0], got[1]};
    comm.broadcast(n, ins, outs, 3, DType::kInt32, 5);
    CHECK(got[0][2] == 52 && got[1][0] == 50);
    got[0][0] = got[1][0] = -1;
    comm.reduce(n, ins, outs, 3, DType::kInt32, ReduceOp::kMax, 3);  // replica 3: task 1, local 1
    CHECK(rank == 1 ? got[1][0] == 50 && got[0][0] == -1 : got[0][0] == -1 && got[1][0] == -1);
    // Replica g contributes g + 1 bytes per row, two rows.
    std::vector<std::vector<char>> rows(n);
    std::size_t row_bytes[n];
    for (int j = 0; j < n; ++j) {
      const int g = rank * n + j;
      row_bytes[j] = static_cast<std::size_t>(g + 1);
      rows[j].assign(2 * row_bytes[j], static_cast<char>('a' + g));
    }
    std::vector<char> g0(2 * 21), g1(2 * 21);
    const void* gin[n] = {rows[0].data(), rows[1].data()};
    void* gout[n] = {g0.data(), g1.data()};
    comm.all_gather(n, gin, gout, row_bytes, 2);
    CHECK(std::string(g0.begin(), g0.begin() + 21) == "abbcccddddeeeeeffffff" && g0 == g1);
    comm.barrier();
  });
}

TEST(a_departed_peer_is_named) {
  job(1, milliseconds(5000), "departed", [](int rank, GlooCommunicator& comm) {
    float x = 1;
    const void* in[1] = {&x};
    void* out[1] = {&x};
    comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
    if (rank == 2) {
      comm.close();  // as a process exiting would: its sockets close
      return;
    }
    bool named = false;
    try {
      comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
    } catch (const PeerLost& e) {
      named = std::strstr(e.what(), "worker:1") != nullptr;
    }
    CHECK(named);
  });
}

TEST(a_late_peer_is_named_at_the_timeout) {
  job(1, milliseconds(300), "late", [](int rank, GlooCommunicator& comm) {
    double x = 1;
    const void* in[1] = {&x};
    void* out[1] = {&x};
    if (rank == 1) std::this_thread::sleep_for(milliseconds(1500));
    // Every rank, the late one included, learns who held the job up.
    bool named = false;
    try {
      comm.all_reduce(1, in, out, 1, DType::kFloat64, ReduceOp::kSum, Algorithm::kAuto);
    } catch (const PeerTimeout& e) {
      named = std::strstr(e.what(), "worker:0 did not reach this collective") != nullptr;
    }
    CHECK(named);
  });
}

TEST(a_call_timeout_bounds_that_call_alone) {
  // The communicator has no timeout; one call's CallTimeout ends it while
  // worker:0 stays away (it waits for the others' failure, not a fixed time).
  std::atomic<int> failed{0};
  job(1, milliseconds(0), "call-timeout", [&failed](int rank, GlooCommunicator& comm) {
    float x = 1;
    const void* in[1] = {&x};
    void* out[1] = {&x};
    comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
    if (rank == 1) {
      const Deadline give_up = after(milliseconds(60000));
      while (failed.load() < 2 && Clock::now() < give_up) std::this_thread::sleep_for(milliseconds(10));
      CHECK(failed.load() == 2);
      return;
    }
    const auto started = Clock::now();
    bool named = false;
    try {
      GlooCommunicator::CallTimeout bound(milliseconds(300));
      comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
    } catch (const PeerTimeout& e) {
      named = std::strstr(e.what(), "worker:0 did not reach this collective") != nullptr;
    } catch (const PeerLost& e) {
      // Woken by the other waiter's abort: it has named the late task already.
      named = std::strstr(e.what(), "worker:0") != nullptr;
    }
    CHECK(named);
    CHECK(Clock::now() - started < std::chrono::seconds(30));
    failed.fetch_add(1);
    // The job's collectives are broken from then on: a call without a CallTimeout raises at once.
    bool broken = false;
    try {
      comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
    } catch (const PeerLost& e) {
      broken = std::strstr(e.what(), "broken since") != nullptr;
    }
    CHECK(broken);
  });
}

// --- the store under hostile local peers -----------------------------------------------------

namespace {

Socket raw_connection(int port) {
  std::string error;
  Socket s = try_connect("127.0.0.1", port, after(milliseconds(2000)), &error);
  CHECK(s.valid());
  return s;
}

// True when the server closed `s` within `wait` (whatever it sent before).
bool closed_by_server(Socket& s, milliseconds wait) {
  const Deadline deadline = after(wait);
  char buf[256];
  while (Clock::now() < deadline) {
    const ssize_t r = ::recv(s.fd(), buf, sizeof(buf), MSG_DONTWAIT);
    if (r == 0 || (r < 0 && errno != EAGAIN && errno != EWOULDBLOCK)) return true;
    if (r < 0) std::this_thread::sleep_for(milliseconds(10));
  }
  return false;
}

template <typename Pred>
bool eventually(Pred&& pred, milliseconds wait = milliseconds(5000)) {
  const Deadline deadline = after(wait);
  while (!pred()) {
    if (Clock::now() >= deadline) return false;
    std::this_thread::sleep_for(milliseconds(10));
  }
  return true;
}

std::vector<char> le32(std::uint32_t v) {
  return {static_cast<char>(v), static_cast<char>(v >> 8), static_cast<char>(v >> 16), static_cast<char>(v >> 24)};
}

}  // namespace

TEST(store_limits_hold_against_strangers) {
  StoreLimits limits;
  limits.max_pending = 4;
  limits.handshake_timeout = milliseconds(400);
  StoreServer server("127.0.0.1", 0, "secret", 2, limits, {"chief:0", "worker:0"});
  // A flood of idle strangers: at most max_pending are kept, the oldest go first.
  std::vector<Socket> idle;
  for (int i = 0; i < 40; ++i) idle.push_back(raw_connection(server.port()));
  CHECK(eventually([&] { return server.stats().dropped >= 36; }));
  CHECK(server.stats().pending <= 4);
  CHECK(closed_by_server(idle[0], milliseconds(2000)));
  // A task of the job still gets in, and the rest of the strangers time out.
  StoreClient a("127.0.0.1", server.port(), "secret", 0, "chief:0", milliseconds(5000));
  a.set("k", {'v'});
  CHECK(eventually([&] { return server.stats().pending == 0; }));
  CHECK(closed_by_server(idle.back(), milliseconds(2000)));

  // Garbage, and a right magic announcing a 2 GiB token: dropped at once, nothing allocated for it.
  Socket garbage = raw_connection(server.port());
  garbage.write_all("GET / HTTP/1.1\r\n\r\n", 18, after(milliseconds(1000)));
  CHECK(closed_by_server(garbage, milliseconds(1000)));
  Socket huge = raw_connection(server.port());
  std::vector<char> msg{'M', 'R', 'V', '2'};
  const auto len = le32(0x7fffffffu);
  msg.insert(msg.end(), len.begin(), len.end());
  huge.write_all(msg.data(), msg.size(), after(milliseconds(1000)));
  CHECK(closed_by_server(huge, milliseconds(1000)));
  CHECK(server.stats().buffered_bytes < 4096);
  CHECK(a.get("k") == std::vector<char>{'v'});
}

TEST(store_limits_hold_against_the_jobs_own_clients) {
  StoreLimits limits;
  limits.max_value = 1024;
  limits.max_keys = 8;
  limits.max_stored_bytes = 4096;
  limits.max_per_task = 2;
  StoreServer server("127.0.0.1", 0, "secret", 2, limits);
  StoreClient a("127.0.0.1", server.port(), "secret", 0, "chief:0", milliseconds(5000), {}, "a");
  for (int i = 0; i < 8; ++i) a.set("key" + std::to_string(i), std::vector<char>(100, 'x'));
  std::string why;
  try {
    a.set("one more", {'x'});
  } catch (const Refused& e) {
    why = e.what();
  }
  CHECK(why.find("the rendezvous store is full (8 keys") != std::string::npos);
  a.set("key0", std::vector<char>(1000, 'y'));  // replacing a key is fine within the byte limit
  CHECK(a.get("key0").size() == 1000);
  CHECK(server.stats().keys == 8);
  // A value above the limit announced by a client of the job: its connection is dropped, the store stays.
  StoreClient b("127.0.0.1", server.port(), "secret", 1, "chief:0", milliseconds(5000), {}, "b");
  bool dropped = false;
  try {
    b.set("big", std::vector<char>(2000, 'z'));
  } catch (const PeerLost&) {
    dropped = true;
  }
  CHECK(dropped);
  CHECK(a.get("key1").size() == 100);
  // One task cannot hold more than max_per_task connections.
  StoreClient a2("127.0.0.1", server.port(), "secret", 0, "chief:0", milliseconds(5000), {}, "a");
  bool busy = false;
  try {
    StoreClient a3("127.0.0.1", server.port(), "secret", 0, "chief:0", milliseconds(5000), {}, "a");
  } catch (const Refused& e) {
    busy = std::strstr(e.what(), "rank 0 already has 2 open connections") != nullptr;
  }
  CHECK(busy);
}

TEST(store_names_duplicate_and_stale_tasks) {
  StoreServer server("127.0.0.1", 0, "t", 2, {}, {"chief:0", "worker:0"});
  auto first = std::make_unique<StoreClient>("127.0.0.1", server.port(), "t", 1, "chief:0", milliseconds(5000),
                                             StoreClient::WaitCallback{}, "first process");
  std::string why;
  try {
    StoreClient twin("127.0.0.1", server.port(), "t", 1, "chief:0", milliseconds(5000), {}, "second process");
  } catch (const Refused& e) {
    why = e.what();
  }
  CHECK(why.find("worker:0 joined twice: it is already connected as first process, and second process claims") !=
        std::string::npos);
  // The same process may connect again; once it has left, another process cannot take its place.
  auto again = std::make_unique<StoreClient>("127.0.0.1", server.port(), "t", 1, "chief:0", milliseconds(5000),
                                             StoreClient::WaitCallback{}, "first process");
  first.reset();
  again.reset();
  StoreClient observer("127.0.0.1", server.port(), "t", 0, "chief:0", milliseconds(5000));
  CHECK(eventually([&] { return observer.status()[1].departed; }));
  why.clear();
  try {
    StoreClient restarted("127.0.0.1", server.port(), "t", 1, "chief:0", milliseconds(5000), {}, "restarted");
  } catch (const Refused& e) {
    why = e.what();
  }
  CHECK(why.find("worker:0 already took part in the job that chief:0 serves") != std::string::npos);
}

TEST(store_deadlines_never_overflow) {
  StoreServer server("127.0.0.1", 0, "t", 1);
  StoreClient a("127.0.0.1", server.port(), "t", 0, "chief:0", milliseconds::max());
  a.set("k", {'1'});
  CHECK(a.wait({"k"}, milliseconds::max()).empty());
  const auto started = Clock::now();
  CHECK(a.wait({"absent"}, milliseconds(-5)).size() == 1);
  CHECK(Clock::now() - started < milliseconds(2000));
  CHECK(after(milliseconds::max()) == never());
  const Deadline past = after(milliseconds(-1));
  CHECK(past <= Clock::now());
}

// Ranks that disagree on a collective all get the same CollectiveMismatch
// before any data moves, and the next matched collective is exact; over
// shared memory and over Gloo.
TEST(a_mismatch_is_the_same_error_everywhere_and_harmless) {
  const char* was = std::getenv("MIRRORED_SHM");
  const std::string saved = was ? was : "";
  for (const char* shm : {"1", "0"}) {
    ::setenv("MIRRORED_SHM", shm, 1);
    job(1, milliseconds(10000), std::string("mismatch") + shm, [](int rank, GlooCommunicator& comm) {
      float x[4] = {1, 1, 1, 1};
      const void* in[1] = {x};
      void* out[1] = {x};
      std::string error;
      try {
        comm.all_reduce(1, in, out, rank == 2 ? 4 : 3, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
      } catch (const CollectiveMismatch& e) {
        error = e.what();
      }
      CHECK(error.find("all_reduce #1: chief:0 passes 3 float32 elements (sum), worker:1 passes 4 float32") == 0);
      CHECK(x[0] == 1 && x[3] == 1);  // nothing moved
      try {
        comm.broadcast(1, in, out, 4, DType::kFloat32, rank);  // each names itself the root
      } catch (const CollectiveMismatch& e) {
        error = e.what();
      }
      CHECK(error.find("broadcast #2: chief:0 passes 4 float32 elements from replica 0, worker:0 passes 4 float32 "
                       "elements from replica 1") == 0);
      comm.all_reduce(1, in, out, 4, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
      CHECK(x[0] == 3 && x[3] == 3);
    });
  }
  if (was) ::setenv("MIRRORED_SHM", saved.c_str(), 1);
  else ::unsetenv("MIRRORED_SHM");
}

// A batch is fused by the engines' packer and every tensor comes back as the
// job's reduction, whatever the packing; in place too.
TEST(batch_all_reduce_matches_the_reference) {
  constexpr int n = 2;
  constexpr int replicas = 3 * n;
  job(n, milliseconds(10000), "batch", [](int rank, GlooCommunicator& comm) {
    // Mixed dtypes and sizes (an empty tensor among them), in an order that interleaves the dtypes.
    const std::vector<std::size_t> counts{3, 1, 0, 700, 5, 40000, 2};
    const std::vector<DType> dtypes{DType::kFloat32, DType::kInt32, DType::kFloat32, DType::kFloat32,
                                    DType::kInt32,   DType::kFloat32, DType::kInt32};
    const int T = static_cast<int>(counts.size());
    struct Packing {
      std::size_t bytes_per_pack;
      int num_packs;
    };
    for (const Packing packing : {Packing{0, 0}, Packing{64, 0}, Packing{0, 3}, Packing{1, 0}}) {
      for (ReduceOp op : {ReduceOp::kSum, ReduceOp::kMax}) {
        for (bool in_place : {false, true}) {
          // 4-byte elements either way: float32 and int32 share the storage.
          std::vector<std::vector<std::uint32_t>> in(n * T), out(n * T);
          std::vector<const void*> ins(n * T);
          std::vector<void*> outs(n * T);
          for (int k = 0; k < n; ++k)
            for (int t = 0; t < T; ++t) {
              auto& v = in[k * T + t];
              v.resize(counts[t]);
              for (std::size_t i = 0; i < counts[t]; ++i) {
                const float x = value(rank * n + k, i + t);
                if (dtypes[t] == DType::kFloat32) std::memcpy(&v[i], &x, 4);
                else v[i] = static_cast<std::uint32_t>(static_cast<std::int32_t>(x));
              }
              out[k * T + t].assign(counts[t], 0xdeadbeef);
              ins[k * T + t] = v.data();
              outs[k * T + t] = in_place ? static_cast<void*>(v.data()) : out[k * T + t].data();
            }
          comm.batch_all_reduce(n, T, ins.data(), outs.data(), counts.data(), dtypes.data(), op,
                                packing.bytes_per_pack, packing.num_packs, Algorithm::kAuto, op);
          for (int t = 0; t < T; ++t)
            for (std::size_t i = 0; i < counts[t]; i += (counts[t] < 997 ? 1 : 97)) {
              float want = op == ReduceOp::kSum ? 0.0f : -1e9f;
              for (int g = 0; g < replicas; ++g)
                want = op == ReduceOp::kSum ? want + value(g, i + t) : std::max(want, value(g, i + t));
              for (int k = 0; k < n; ++k) {
                const std::uint32_t got = (in_place ? in : out)[k * T + t][i];
                if (dtypes[t] == DType::kFloat32) {
                  float f;
                  std::memcpy(&f, &got, 4);
                  CHECK(f == want);
                } else {
                  CHECK(static_cast<std::int32_t>(got) == static_cast<std::int32_t>(want));
                }
              }
            }
        }
      }
    }
  });
}

// Batches that differ only in how their elements split into tensors have
// packs of the same size: the layout digest still makes every rank raise the
// same error before any data moves; a batch against a plain all_reduce too.
TEST(batches_that_differ_raise_the_same_error_everywhere) {
  job(1, milliseconds(10000), "batch-mismatch", [](int rank, GlooCommunicator& comm) {
    float a[3] = {1, 1, 1}, b[5] = {1, 1, 1, 1, 1};
    const std::size_t counts[2] = {rank == 1 ? 5u : 3u, rank == 1 ? 3u : 5u};
    float* first = rank == 1 ? b : a;
    float* second = rank == 1 ? a : b;
    const void* in[2] = {first, second};
    void* out[2] = {first, second};
    const DType dtypes[2] = {DType::kFloat32, DType::kFloat32};
    std::string error;
    try {
      comm.batch_all_reduce(1, 2, in, out, counts, dtypes, ReduceOp::kSum, 0, 0, Algorithm::kAuto, ReduceOp::kSum);
    } catch (const CollectiveMismatch& e) {
      error = e.what();
    }
    CHECK(error.find("batch_all_reduce #1: chief:0 and worker:0 pass batches that differ in their tensors' sizes or "
                     "dtypes, or in bytes_per_pack / num_packs") == 0);
    CHECK(a[0] == 1 && b[4] == 1);  // nothing moved
    error.clear();
    float eight[8] = {};
    const void* plain_in[1] = {eight};
    void* plain_out[1] = {eight};
    try {
      if (rank == 0)
        comm.all_reduce(1, plain_in, plain_out, 8, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
      else
        comm.batch_all_reduce(1, 2, in, out, counts, dtypes, ReduceOp::kSum, 0, 0, Algorithm::kAuto, ReduceOp::kSum);
    } catch (const CollectiveMismatch& e) {
      error = e.what();
    }
    CHECK(error.find("collective #2: worker:0 calls batch_all_reduce, chief:0 calls all_reduce") == 0);
    // The job goes on: a matched batch is exact.
    const std::size_t same[2] = {3, 5};
    const void* in2[2] = {a, b};
    void* out2[2] = {a, b};
    comm.batch_all_reduce(1, 2, in2, out2, same, dtypes, ReduceOp::kSum, 0, 0, Algorithm::kAuto, ReduceOp::kSum);
    CHECK(a[0] == 3 && b[4] == 3);
  });
}

// agree_gather returns every replica's extent along the axis, in job order;
// shapes that differ off the axis (here or on a peer) raise the same error on
// every rank, and the gather after it is exact.
TEST(agree_gather_checks_the_shape_table_everywhere) {
  constexpr int n = 2;
  job(n, milliseconds(10000), "gather-table", [](int rank, GlooCommunicator& comm) {
    // Replica g has g + 1 rows of 3 int32 columns.
    std::vector<std::vector<std::uint64_t>> shapes;
    for (int j = 0; j < n; ++j) shapes.push_back({static_cast<std::uint64_t>(rank * n + j + 1), 3});
    const auto extents = comm.agree_gather(n, DType::kInt32, 0, shapes);
    CHECK(extents == (std::vector<std::uint64_t>{1, 2, 3, 4, 5, 6}));
    std::vector<std::vector<std::int32_t>> in(n);
    for (int j = 0; j < n; ++j) in[j].assign(shapes[j][0] * 3, rank * n + j);
    std::vector<std::int32_t> out0(21 * 3), out1(21 * 3);
    const void* ins[n] = {in[0].data(), in[1].data()};
    void* outs[n] = {out0.data(), out1.data()};
    std::vector<std::uint64_t> row_bytes;
    for (auto e : extents) row_bytes.push_back(e * 3 * sizeof(std::int32_t));
    comm.all_gather_planned(n, ins, outs, row_bytes.data(), 1);
    CHECK(out0[0] == 0 && out0[3] == 1 && out0[9] == 2 && out0.back() == 5 && out0 == out1);
    // worker:1's second replica has 4 columns: nothing is gathered.
    if (rank == 2) shapes[1][1] = 4;
    std::string error;
    try {
      comm.agree_gather(n, DType::kInt32, 0, shapes);
    } catch (const CollectiveMismatch& e) {
      error = e.what();
    }
    CHECK(error.find("all_gather #2: chief:0 passes int32 buffers of shape (1, 3), (2, 3) gathered along axis 0, "
                     "worker:1 passes int32 buffers of shape (5, 3), (6, 4) gathered along axis 0; every worker must "
                     "pass the same dtype, number of dimensions and axis") == 0);
    // One dimension: the shape reads as Python prints a 1-tuple.
    error.clear();
    try {
      comm.agree_gather(n, rank == 0 ? DType::kInt32 : DType::kFloat32, 0, {{2}, {2}});
    } catch (const CollectiveMismatch& e) {
      error = e.what();
    }
    CHECK(error.find("all_gather #3: chief:0 passes int32 buffers of shape (2,), (2,) gathered along axis 0, "
                     "worker:0 passes float32 buffers") == 0);
    // Along axis 1 the rows must agree and the columns may differ.
    const auto columns = comm.agree_gather(n, DType::kInt32, 1, {{2, 1}, {2, static_cast<std::uint64_t>(rank + 2)}});
    CHECK(columns == (std::vector<std::uint64_t>{1, 2, 1, 3, 1, 4}));
  });
}

std::string hex(const Digest& d) {
  static const char digits[] = "0123456789abcdef";
  std::string out;
  for (unsigned char c : d) out += std::string{digits[c >> 4], digits[c & 15]};
  return out;
}

// FIPS 180-4's examples and RFC 4231's test cases 1, 2 and 6 (a key longer than a block).
TEST(sha256_and_hmac_match_the_published_vectors) {
  CHECK(hex(Sha256().finish()) == "e3b0c44298fc1c149afbf4c8996fb92427ae41e4649b934ca495991b7852b855");
  CHECK(hex(Sha256().update("abc").finish()) == "ba7816bf8f01cfea414140de5dae2223b00361a396177a9cb410ff61f20015ad");
  CHECK(hex(Sha256().update("abcdbcdecdefdefgefghfghighijhijkijkljklmklmnlmnomnopnopq").finish()) ==
        "248d6a61d20638b8e5c026930c3e6039a33ce45964ff2167f6ecedd419db06c1");
  CHECK(hex(hmac_sha256(std::string(20, '\x0b'), "Hi There")) ==
        "b0344c61d8db38535ca8afceaf0bf12b881dc200c9833da726e9376c2e32cff7");
  CHECK(hex(hmac_sha256("Jefe", "what do ya want for nothing?")) ==
        "5bdcc146bf60754e6a042426089575c75a003f089d2739839dec58b964ec3843");
  CHECK(hex(hmac_sha256(std::string(131, '\xaa'), "Test Using Larger Than Block-Size Key - Hash Key First")) ==
        "60e431591ee0b67f0d8a26aacbf5b77f8e0bc6213728c5140546040f0ee37f54");
  CHECK(random_bytes(16) != random_bytes(16));
}

// Strangers reach rank 0's mesh listener before any peer does: silent, with
// garbage, claiming a peer's rank without the token, or leaving at once.
// Each is dropped; the job's peers join and compute as if nobody came.
TEST(strangers_at_the_mesh_listener_are_dropped_and_the_job_runs) {
  StoreServer server("127.0.0.1", 0, "token", 4);  // rank 3: this test, to learn where rank 0 listens
  StoreClient spy("127.0.0.1", server.port(), "token", 3, kTasks[0], milliseconds(10000));
  std::atomic<bool> strangers_in{false};
  float results[3] = {0, 0, 0};
  std::vector<std::thread> threads;
  for (int rank = 0; rank < 3; ++rank)
    threads.emplace_back([&, rank] {
      while (rank > 0 && !strangers_in.load()) std::this_thread::sleep_for(milliseconds(1));
      auto store = std::make_shared<StoreClient>("127.0.0.1", server.port(), "token", rank, kTasks[0],
                                                 milliseconds(20000));
      GlooCommunicator comm(store, kTasks, 1, "127.0.0.1", milliseconds(20000), "strangers");
      float x = static_cast<float>(rank + 1);
      const void* in[1] = {&x};
      void* out[1] = {&x};
      comm.all_reduce(1, in, out, 1, DType::kFloat32, ReduceOp::kSum, Algorithm::kAuto);
      results[rank] = x;
    });
  // Ranks 1 and 2 have not started: announce them, so that rank 0 goes on to listen for the mesh.
  const std::int64_t one = 1;
  for (const char* key : {"strangers/replicas/1", "strangers/replicas/2"})
    spy.set(key, std::vector<char>(reinterpret_cast<const char*>(&one), reinterpret_cast<const char*>(&one) + 8));
  CHECK(spy.wait({"strangers/mesh/0"}, milliseconds(20000)).empty());
  const auto v = spy.get("strangers/mesh/0");
  const std::string at(v.begin(), v.end());
  const int port = std::stoi(at.substr(at.rfind(' ') + 1));
  std::string error;
  auto stranger = [&] { return try_connect("127.0.0.1", port, after(milliseconds(5000)), &error); };
  Socket silent = stranger();
  Socket garbage = stranger();
  const std::string junk(64, '\xab');
  garbage.write_all(junk.data(), junk.size(), after(milliseconds(5000)));
  stranger();  // connects and leaves
  // A well-formed hello for rank 1, then a proof made without the token.
  Socket impostor = stranger();
  std::string hello("mrdmesh1\x01\0\0\0\0\0\0\0", 16);
  hello += std::string(16, 'n');
  impostor.write_all(hello.data(), hello.size(), after(milliseconds(5000)));
  char reply[48];
  impostor.read_exact(reply, sizeof(reply), after(milliseconds(5000)));
  const std::string guess(32, 'g');
  impostor.write_all(guess.data(), guess.size(), after(milliseconds(5000)));
  bool dropped = false;
  try {
    char admitted;
    impostor.read_exact(&admitted, 1, after(milliseconds(10000)));
  } catch (const PeerLost&) {
    dropped = true;
  }
  CHECK(dropped);
  CHECK(silent.valid() && !silent.peer_closed());  // still waiting its turn: it blocks nobody
  strangers_in = true;
  for (auto& t : threads) t.join();
  CHECK(results[0] == 6 && results[1] == 6 && results[2] == 6);
}

// A peer that is gone is named with the port it listened on (Gloo's own
// message printed it byte-swapped).
TEST(a_gone_peer_is_named_with_its_port) {
  StoreServer server("127.0.0.1", 0, "token", 2);
  int port = 0;
  { Socket closed = listen_on("127.0.0.1", 0, &port); }  // nothing listens there any more
  StoreClient gone("127.0.0.1", server.port(), "token", 0, "chief:0", milliseconds(5000));
  const std::int64_t one = 1;
  gone.set("gone/replicas/0", std::vector<char>(reinterpret_cast<const char*>(&one),
                                                reinterpret_cast<const char*>(&one) + sizeof(one)));
  const std::string at = "127.0.0.1 " + std::to_string(port);
  gone.set("gone/mesh/0", std::vector<char>(at.begin(), at.end()));
  auto store = std::make_shared<StoreClient>("127.0.0.1", server.port(), "token", 1, "chief:0", milliseconds(5000));
  std::string why;
  try {
    GlooCommunicator comm(store, {"chief:0", "worker:0"}, 1, "127.0.0.1", milliseconds(5000), "gone");
  } catch (const PeerLost& e) {
    why = e.what();
  }
  CHECK(why.find("task chief:0 at 127.0.0.1:" + std::to_string(port) + " refused the connection") !=
        std::string::npos);
}

int main() { return check::run_all(); }
