// The rendezvous store and the Gloo communicator in C++, with the processes
// of a job played by threads (what the sanitizer builds exercise): results
// against a reference, admission, and the naming of dead and late peers.
#include <chrono>
#include <cstdlib>
#include <cstdint>
#include <cstring>
#include <functional>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "check.h"
#include "net/errors.h"
#include "net/gloo_communicator.h"

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

int main() { return check::run_all(); }
