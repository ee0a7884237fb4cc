// The schedules of csrc/core, checked as data: every element is reduced
// exactly once per participant's contribution, every participant ends with
// every chunk, and each op only depends on what its peer did one step before.
#include <cstddef>
#include <vector>

#include "check.h"
#include "core/packer.h"
#include "core/partition.h"
#include "core/ring_schedule.h"
#include "core/tree_schedule.h"

using namespace mirrored;

namespace {

// Simulates the ring symbolically: each participant's output element holds
// the set of contributors folded into it (a bitmask), so a double count or a
// missing contribution shows up exactly.
void simulate_ring(int n, std::size_t count, std::size_t chunk) {
  const RingSchedule s(n, count, chunk);
  using Mask = unsigned long long;
  std::vector<std::vector<Mask>> in(n, std::vector<Mask>(count)), out(n, std::vector<Mask>(count, 0));
  std::vector<std::vector<int>> writes(n, std::vector<int>(count, 0));
  for (int r = 0; r < n; ++r)
    for (auto& m : in[r]) m = Mask{1} << r;
  bool covered_once = true, disjoint = true;
  for (std::size_t slice = 0; slice < s.num_slices(); ++slice) {
    for (int step = 0; step < s.num_steps(); ++step) {
      for (int rank = 0; rank < n; ++rank) {
        const RingOp o = s.op(slice, step, rank);
        CHECK(o.rank == rank && o.peer == (rank + n - 1) % n);
        CHECK(o.offset + o.count <= count);
        for (std::size_t i = o.offset; i < o.offset + o.count; ++i) {
          const Mask peer = o.peer_input ? in[o.peer][i] : out[o.peer][i];
          if (o.verb == RingVerb::kReduceCopy) {
            if (in[rank][i] & peer) disjoint = false;  // a contribution counted twice
            out[rank][i] = in[rank][i] | peer;
          } else {
            out[rank][i] = peer;
          }
          ++writes[rank][i];
        }
      }
    }
  }
  const Mask all = (n == 64) ? ~Mask{0} : (Mask{1} << n) - 1;
  for (int r = 0; r < n; ++r)
    for (std::size_t i = 0; i < count; ++i) {
      if (n > 1 && out[r][i] != all) covered_once = false;
      // Each output element is written once in reduce-scatter (or not at
      // all for the rank that finalises a different chunk) and once in
      // all-gather: at most twice, at least once.
      if (n > 1 && (writes[r][i] < 1 || writes[r][i] > 2)) covered_once = false;
    }
  CHECK(covered_once);
  CHECK(disjoint);
}

}  // namespace

TEST(ring_every_participant_ends_with_every_contribution_once) {
  for (int n : {1, 2, 3, 4, 5, 8, 13})
    for (std::size_t count : {0ul, 1ul, 2ul, 7ul, 64ul, 1000ul, 4097ul})
      for (std::size_t chunk : {1ul, 3ul, 64ul, 1024ul}) simulate_ring(n, count, chunk);
}

TEST(ring_finalize_marks_exactly_one_op_per_element) {
  for (int n : {2, 3, 4, 7}) {
    const std::size_t count = 1001;
    const RingSchedule s(n, count, 16);
    std::vector<int> finals(count, 0);
    for (std::size_t slice = 0; slice < s.num_slices(); ++slice)
      for (int step = 0; step < s.num_steps(); ++step)
        for (int rank = 0; rank < n; ++rank) {
          const RingOp o = s.op(slice, step, rank);
          if (o.finalize)
            for (std::size_t i = o.offset; i < o.offset + o.count; ++i) ++finals[i];
        }
    bool once = true;
    for (int f : finals) once = once && f == 1;
    CHECK(once);
  }
}

TEST(ring_rejects_zero_participants) {
  bool threw = false;
  try {
    RingSchedule s(0, 10, 1);
  } catch (const std::invalid_argument&) {
    threw = true;
  }
  CHECK(threw);
}

TEST(tree_folds_every_rank_into_rank_zero_once) {
  for (int n = 1; n <= 33; ++n) {
    const TreeSchedule t(n);
    std::vector<unsigned long long> in(n), out(n, 0);
    std::vector<bool> written(n, false);
    for (int r = 0; r < n; ++r) in[r] = 1ull << r;
    int finals = 0;
    for (int level = 0; level < t.num_levels(); ++level)
      for (int i = 0; i < t.num_ops(level); ++i) {
        const TreeOp o = t.op(level, i);
        CHECK(o.src < n && o.dst < o.src);
        CHECK(o.dst_input == !written[o.dst]);
        CHECK(o.src_input == !written[o.src]);
        const auto a = o.dst_input ? in[o.dst] : out[o.dst];
        const auto b = o.src_input ? in[o.src] : out[o.src];
        CHECK((a & b) == 0);
        out[o.dst] = a | b;
        written[o.dst] = true;
        finals += o.finalize;
      }
    if (n > 1) {
      CHECK(out[0] == (n == 64 ? ~0ull : (1ull << n) - 1));
      CHECK(finals == 1);
    }
  }
}

TEST(partition_covers_everything_on_cache_line_boundaries) {
  for (std::size_t count : {0ul, 1ul, 15ul, 16ul, 17ul, 1000003ul})
    for (int parts : {1, 2, 3, 16}) {
      std::size_t next = 0;
      for (int p = 0; p < parts; ++p) {
        const Range r = partition(count, 4, p, parts);
        CHECK(r.begin == next || r.size() == 0);
        if (r.size()) {
          CHECK((r.begin * 4) % 64 == 0);
          next = r.end;
        }
      }
      CHECK(next == count);
    }
}

TEST(packer_groups_by_dtype_and_honours_limits) {
  const std::vector<std::size_t> bytes = {400, 400, 400, 8, 1200, 40};
  const std::vector<DType> types = {DType::kFloat32, DType::kFloat32, DType::kInt32, DType::kFloat32,
                                    DType::kFloat32, DType::kInt32};
  // One pack per dtype.
  auto packs = plan_packs(bytes, types, 0, 0);
  CHECK(packs.size() == 2);
  CHECK(packs[0].dtype == DType::kFloat32 && packs[0].bytes == 2008 && packs[0].entries.size() == 4);
  CHECK(packs[1].dtype == DType::kInt32 && packs[1].bytes == 440);
  // Byte limit: a tensor over the limit travels alone; none exceeds it otherwise.
  packs = plan_packs(bytes, types, 800, 0);
  std::size_t entries = 0;
  for (const Pack& p : packs) {
    entries += p.entries.size();
    CHECK(p.bytes <= 800 || p.entries.size() == 1);
    std::size_t off = 0;
    for (const PackEntry& e : p.entries) {
      CHECK(e.offset == off && types[e.tensor] == p.dtype && bytes[e.tensor] == e.bytes);
      off += e.bytes;
    }
  }
  CHECK(entries == bytes.size());
  // num_packs: at most that many per dtype.
  packs = plan_packs(bytes, types, 0, 2);
  int f32 = 0, i32 = 0;
  for (const Pack& p : packs) (p.dtype == DType::kFloat32 ? f32 : i32)++;
  CHECK(f32 <= 2 && i32 <= 2 && f32 >= 1 && i32 >= 1);
}

int main() { return check::run_all(); }
