// The core: the ring of records in memory, each group's counters, and completion tracking.
//
// Locking: one mutex (Core::mu_) guards the ring and the groups' counters. It is never held while
// taking the GIL, and nothing that may take the GIL runs under it: a Work released under it is
// moved out first and dropped after unlocking (a gloo work's tensors can need the GIL to be
// freed; a thread holding the GIL may be waiting for the mutex).
#pragma once

#include <atomic>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <vector>

#include "record.h"
#include "ring_file.h"
#include "stacks.h"

namespace tether {

using Works = std::vector<c10::intrusive_ptr<c10d::Work>>;  // dropped after unlocking

class Core : public std::enable_shared_from_this<Core> {
 public:
  // is_library(filename) -> bool: a file of torch, the standard library or tether's own;
  // walk_on: how far past stack_depth a stack is walked for the first other frame (both as
  // recorder/frames.py's capture); p2p_seq_base: where p2p sequence numbers start
  // (events/schema.P2P_SEQ_BASE); ring_path: the ring file (empty: none), whose records start
  // at records_at.
  Core(size_t capacity, int stack_depth, py::object is_library, int walk_on,
       int64_t p2p_seq_base, const std::string& ring_path, size_t records_at);

  bool ring_file_open() const { return file_.open(); }
  int32_t add_group(int32_t rank);

  // -- the issue path (no GIL held; takes it only to capture the stack) -------------------------
  // Record an operation as it is issued (state "scheduled"), `fill` adding its tensors; -1 where
  // recording it failed: a recorder bug never fails the user's collective.
  template <typename Fill>
  int64_t begin(int32_t gid, Op op, const std::string& backend, int peer, Fill&& fill) noexcept {
    try {
      std::vector<FrameRef>& frames = capture();
      Works dead;
      std::lock_guard<std::mutex> g(mu_);  // released before `dead` goes
      Rec& r = open(gid, op, backend, peer, dead);
      fill(r);
      return close(r, frames);
    } catch (const std::exception& e) {
      bug("recording an operation", e.what());
      return -1;
    }
  }
  void start_coalescing(int32_t gid);
  // The entry closing a coalescing block ("<backend>:coalesced"); -1 if the block was empty.
  int64_t end_coalescing(int32_t gid);
  // The backend accepted the operation: state "started"; returns the work to hand the caller.
  c10::intrusive_ptr<c10d::Work> issued(int64_t rid, c10::intrusive_ptr<c10d::Work> work);
  // A synchronous operation (monitoredBarrier returns no work): started as it is called and
  // finished when it returns; never queued, so one that throws stays started in the record.
  void started(int64_t rid);
  void finish(int64_t rid);  // completed now: its wait() returned
  // The backend raised as the operation was issued: it never ran. Its record stays "scheduled",
  // with the error (a dump counts it retired, in its `failed`).
  void refused(int64_t rid, const char* error);

  // -- what Python asks (the watchdog with the GIL released; dumps with it held) ----------------
  void reap(int64_t min_age_ns);
  std::vector<int64_t> inflight();  // every operation still in flight (polled first), oldest first
  int64_t oldest_inflight();  // the oldest not known completed (queue heads, parked); -1: none
  // Keep the group's entries now in the ring past their eviction (the group looks stuck).
  std::vector<int64_t> suspect(int32_t gid);
  // Entries as tuples (see native.py's _entry), oldest first: the ring, then kept ones.
  py::list snapshot(const std::vector<int64_t>& only);
  // The group was reconfigured (torch 2.14+): this process is now `rank` of a new communicator.
  void regroup(int32_t gid, int32_t rank);
  py::tuple group_status(int32_t gid);
  // The operation that finished last in the group, with its work (None, None: none).
  py::tuple last_done(int32_t gid);
  void forget_last_done(int32_t gid, int64_t rid);
  void mark_failed(int64_t rid, const std::string& error);
  size_t capacity() const { return ring_.size(); }
  py::list bugs();  // the recorder bugs since the last call ("what: why"), for Python to log
  // Tests: make the next n recordings ("record") or completion trackings ("track") fail.
  void fail_next(const std::string& what, int n);
  void set_stack_depth(int depth) { stacks_.set_depth(depth); }

 private:
  std::vector<FrameRef>& capture();  // the issuing thread's stack (a failure injected first)
  Rec& open(int32_t gid, Op op, const std::string& backend, int peer, Works& dead);
  int64_t close(Rec& r, const std::vector<FrameRef>& frames);
  c10::intrusive_ptr<c10d::Work> issued_(int64_t rid, c10::intrusive_ptr<c10d::Work> work);
  Rec& slot(int64_t rid, Works& dead);
  const Rec* find(int64_t rid) const;
  Rec* find(int64_t rid) { return const_cast<Rec*>(static_cast<const Core*>(this)->find(rid)); }
  void retire(int64_t rid);
  bool poll(Rec& r, int64_t now, Works& done);
  void complete(Rec& r, int64_t now, Works& done, bool failed = false);
  void drain(Group& grp, int64_t now, int64_t min_age, Works& done);
  void bug(const char* what, const char* why);

  std::mutex mu_;
  std::vector<std::string> bugs_;
  std::atomic<int> fail_record_{0}, fail_track_{0};
  std::vector<Rec> ring_;
  std::map<int64_t, Rec> kept_;   // pinned entries evicted from the ring (dumped)
  std::map<int64_t, Rec> aside_;  // in-flight entries evicted from the ring (watched)
  std::vector<Group> groups_;
  std::vector<int64_t> parked_;
  Works graveyard_;  // released under the mutex
  int64_t next_id_ = 0;
  Stacks stacks_;
  int64_t p2p_seq_base_;
  RingFile file_;
};

}  // namespace tether
