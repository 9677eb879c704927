// What the core keeps of one operation (Rec) and of one group (Group), shared by every unit.
#pragma once

#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <chrono>
#include <cstdint>
#include <deque>
#include <string>
#include <vector>

#include "stacks.h"

namespace tether {

namespace py = pybind11;

enum State : uint8_t { SCHEDULED = 0, STARTED = 1, COMPLETED = 2 };

// The ProcessGroup method (tether/recorder/ops.py's OPS key) and its name in dumps.
enum Op : uint8_t {
  ALLREDUCE, ALLREDUCE_COALESCED, BROADCAST, REDUCE, ALLGATHER, ALLGATHER_BASE,
  ALLGATHER_COALESCED, ALLGATHER_INTO_TENSOR_COALESCED, GATHER, SCATTER, REDUCE_SCATTER,
  REDUCE_SCATTER_BASE, REDUCE_SCATTER_TENSOR_COALESCED, ALLTOALL, ALLTOALL_BASE, BARRIER,
  MONITORED_BARRIER, SEND, RECV, RECV_ANYSOURCE, COALESCED, N_OPS
};
inline constexpr const char* kMethod[N_OPS] = {
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single_coalesced", "alltoall", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "recv_anysource", "_end_coalescing"};
inline constexpr const char* kName[N_OPS] = {
    "all_reduce", "allreduce_coalesced", "broadcast", "reduce", "all_gather", "_all_gather_base",
    "ALLGATHER_coalesced", "all_gather_into_tensor_coalesced", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "recv", "coalesced"};

inline int64_t now_ns() {  // time.time_ns(): the clock the dumps' times are in
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::system_clock::now().time_since_epoch())
      .count();
}

// Shapes and dtypes of one side of an operation, flattened: a per-rank list of buffers counts as
// one buffer of shape (len, *shape), as torch's recorder writes it (see ops.tensors_of).
struct Shapes {
  std::vector<int64_t> dims;
  std::vector<uint8_t> ndims;
  std::vector<int8_t> dtypes;
  void clear() { dims.clear(); ndims.clear(); dtypes.clear(); }
  void add(const at::Tensor& t, int64_t lead = -1) {
    if (lead >= 0) dims.push_back(lead);
    for (auto d : t.sizes()) dims.push_back(d);
    ndims.push_back(static_cast<uint8_t>(t.dim() + (lead >= 0)));
    dtypes.push_back(static_cast<int8_t>(t.scalar_type()));
  }
  void add(const std::vector<at::Tensor>& ts) { for (auto& t : ts) add(t); }
  void add(const std::vector<std::vector<at::Tensor>>& lists) {
    for (auto& l : lists) if (!l.empty()) add(l[0], static_cast<int64_t>(l.size()));
  }
  py::list sizes() const {
    py::list out;
    size_t at = 0;
    for (auto n : ndims) {
      py::list s;
      for (size_t i = 0; i < n; ++i) s.append(dims[at + i]);
      at += n;
      out.append(s);
    }
    return out;
  }
  py::list dtype_names() const {
    py::list out;
    for (auto d : dtypes) out.append(c10::toString(static_cast<c10::ScalarType>(d)));
    return out;
  }
};

struct Rec {
  int64_t record_id = -1;
  int32_t group = -1;
  uint8_t op = 0, state = SCHEDULED;
  bool is_p2p = false, has_out = false, pinned = false, in_use = false;
  int32_t me = 0, peer = -1;
  int64_t seq = 0, p2p_seq = 0, op_id = 0;
  uint64_t thread_id = 0;
  int64_t created = 0, started = 0, completed = 0;
  Shapes in, out;
  std::string backend, error;
  c10::intrusive_ptr<c10d::Work> work;
  std::vector<FrameRef> frames;  // innermost first; empty: no Python stack (or capture off)
};

struct Group {
  int32_t uid = 0, rank = 0;
  int64_t seq = 0, p2p_seq = 0, op_id = 0, last_started = 0, last_completed = 0;
  bool coalescing = false;
  std::vector<int64_t> coalesced;  // record ids of the open coalescing block
  std::deque<int64_t> inflight;    // issued, not yet seen completed, in issue order
  int64_t last_done = -1;          // the operation that finished last, and its work:
  c10::intrusive_ptr<c10d::Work> last_done_work;  // asked whether it failed only at a dump
  std::vector<int8_t> reports;     // per op: -1 unknown, 0 completion only via wait(), 1 polled
};

}  // namespace tether
