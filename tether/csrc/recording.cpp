// tether's native recording core: a c10d::Backend that records every operation of the real
// backends it wraps, registered on a plain torch ProcessGroup (no Python subclass, so no pybind
// trampoline and no GIL on the hot path). Python reads the ring (tether/recorder/native.py).
//
// Locking: one mutex (Core::mu) guards the ring and the groups' counters. It is never held while
// taking the GIL, and nothing that may take the GIL runs under it: a Work released under it is
// moved out first and dropped after unlocking (a gloo work's tensors can need the GIL to be
// freed; a thread holding the GIL may be waiting for the mutex).
//
// Stacks are read without the GIL: the issuing thread walks its own interpreter frames (which
// hold still while it is in here, in C++) and keeps (code, offset) pairs whose code objects the
// core's CodeTable holds; the GIL is taken only the first time a code object is seen.

#include <Python.h>
#include <fcntl.h>
#include <frameobject.h>
// The interpreter's own frame layout, to walk a thread's frames without creating frame objects
// or taking the GIL (greenlet includes it the same way). Written for 3.11 (tested) and 3.12 (whose
// fields read here are the same; not yet built): another Python fails this build, and tether
// falls back to its Python recorder.
#define Py_BUILD_CORE
#include <internal/pycore_frame.h>
#undef Py_BUILD_CORE
#if PY_VERSION_HEX < 0x030B0000 || PY_VERSION_HEX >= 0x030D0000
#error "the native core reads CPython 3.11 and 3.12 frames"
#endif
#include <pthread.h>
#include <sys/mman.h>
#include <unistd.h>

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

// A torch release at least MAJOR.MINOR (feature macros cover what torch names; 2.15's additions
// to c10d::Backend have none).
#define TETHER_TORCH_AT_LEAST(MAJOR, MINOR) \
  (TORCH_VERSION_MAJOR > (MAJOR) || (TORCH_VERSION_MAJOR == (MAJOR) && TORCH_VERSION_MINOR >= (MINOR)))

#include <atomic>
#include <charconv>
#include <chrono>
#include <cstring>
#include <deque>
#include <map>
#include <mutex>
#include <string>
#include <unordered_map>
#include <vector>

namespace py = pybind11;

namespace tether {

enum State : uint8_t { SCHEDULED = 0, STARTED = 1, COMPLETED = 2 };

// The ProcessGroup method (tether/recorder/ops.py's OPS key) and its name in dumps.
enum Op : uint8_t {
  ALLREDUCE, ALLREDUCE_COALESCED, BROADCAST, REDUCE, ALLGATHER, ALLGATHER_BASE,
  ALLGATHER_COALESCED, ALLGATHER_INTO_TENSOR_COALESCED, GATHER, SCATTER, REDUCE_SCATTER,
  REDUCE_SCATTER_BASE, REDUCE_SCATTER_TENSOR_COALESCED, ALLTOALL, ALLTOALL_BASE, BARRIER,
  MONITORED_BARRIER, SEND, RECV, RECV_ANYSOURCE, COALESCED, N_OPS
};
const char* const kMethod[N_OPS] = {
    "allreduce", "allreduce_coalesced", "broadcast", "reduce", "allgather", "_allgather_base",
    "allgather_coalesced", "all_gather_single_coalesced", "gather", "scatter", "reduce_scatter",
    "_reduce_scatter_base", "reduce_scatter_single_coalesced", "alltoall", "all_to_all_single",
    "barrier", "monitored_barrier", "send", "recv", "recv_anysource", "_end_coalescing"};
const char* const kName[N_OPS] = {
    "all_reduce", "allreduce_coalesced", "broadcast", "reduce", "all_gather", "_all_gather_base",
    "ALLGATHER_coalesced", "all_gather_into_tensor_coalesced", "gather", "scatter",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor_coalesced", "all_to_all",
    "all_to_all_single", "barrier", "monitored_barrier", "send", "recv", "recv", "coalesced"};

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

int64_t now_ns() {  // time.time_ns(): the clock the dumps' times are in
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

// One captured frame: a code object the CodeTable holds and its instruction offset in bytes
// (frame.f_lasti). code == nullptr marks an elision: `lasti` frames passed over before the next.
struct FrameRef {
  PyCodeObject* code;
  int32_t lasti;
};

// Every code object met on a captured stack, held (one reference, never released: the table
// lives as long as the core, and code objects on a collective's stack nearly always live as long
// as the program) with whether it is torch's, the standard library's or tether's own. Insert-only
// open addressing: readers take no lock and no GIL; writers hold the GIL, which orders them.
class CodeTable {
 public:
  static constexpr size_t kSlots = size_t{1} << 16;  // 1 MiB; at most half of it is used
  static constexpr size_t kMax = kSlots / 2;
  enum : int8_t { UNKNOWN = -1, USER = 0, LIBRARY = 1 };

  CodeTable() : slots_(new Slot[kSlots]) {}

  int8_t get(const PyCodeObject* code) const {
    for (size_t i = hash(code);; i = (i + 1) & (kSlots - 1)) {
      const PyCodeObject* c = slots_[i].code.load(std::memory_order_acquire);
      if (c == code) return slots_[i].library;
      if (c == nullptr) return UNKNOWN;
    }
  }
  // With the GIL held. False when full (the code is then not held).
  bool add(PyCodeObject* code, bool library) {
    if (used_ >= kMax) return false;
    size_t i = hash(code);
    while (slots_[i].code.load(std::memory_order_relaxed) != nullptr) i = (i + 1) & (kSlots - 1);
    Py_INCREF(code);
    slots_[i].library = library ? LIBRARY : USER;
    slots_[i].code.store(code, std::memory_order_release);  // published with its verdict
    ++used_;
    return true;
  }

 private:
  struct Slot {
    std::atomic<PyCodeObject*> code{nullptr};
    int8_t library = UNKNOWN;
  };
  static size_t hash(const PyCodeObject* code) {
    auto v = reinterpret_cast<uintptr_t>(code) >> 4;  // objects are 16-byte aligned
    return (v * 0x9E3779B97F4A7C15ull >> 20) & (kSlots - 1);
  }
  std::unique_ptr<Slot[]> slots_;
  size_t used_ = 0;
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

constexpr size_t kParkAfter = 32;  // queued behind a stuck head before the head is parked

// The ring file (tether/events/ringfile.py, which documents the layout and reads it): each record
// is written here as it is issued and as it advances, so that a process killed by any signal
// leaves its record in the page cache. The offsets below are ringfile._RECORD's.
class RingFile {
 public:
  static constexpr size_t kRecordSize = 512, kTensors = 4, kDims = 4, kDtype = 12, kName = 48;

  RingFile() = default;
  RingFile(const std::string& path, size_t records_at, size_t capacity)
      : records_at_(records_at), capacity_(capacity) {
    if (path.empty()) return;
    int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
    if (fd < 0) return;
    size_ = records_at + capacity * kRecordSize;
    void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    ::close(fd);
    if (p != MAP_FAILED) base_ = static_cast<uint8_t*>(p);
  }
  ~RingFile() { if (base_ != nullptr) ::munmap(base_, size_); }
  RingFile(const RingFile&) = delete;
  RingFile& operator=(const RingFile&) = delete;
  RingFile& operator=(RingFile&& o) noexcept {
    std::swap(base_, o.base_); std::swap(size_, o.size_);
    records_at_ = o.records_at_; capacity_ = o.capacity_;
    return *this;
  }
  bool open() const { return base_ != nullptr; }

  template <typename R>
  void full(const R& r, const std::string& name) {
    uint8_t* p = begin_write(r.record_id);
    if (p == nullptr) return;
    p[4] = r.state; p[5] = r.is_p2p;
    p[6] = static_cast<uint8_t>(std::min<size_t>(r.in.ndims.size(), 254));
    p[7] = r.has_out ? static_cast<uint8_t>(std::min<size_t>(r.out.ndims.size(), 254)) : 255;
    put<int64_t>(p, 8, r.record_id); put<int32_t>(p, 16, r.group);
    put<int64_t>(p, 24, r.seq); put<int64_t>(p, 32, r.p2p_seq); put<int64_t>(p, 40, r.op_id);
    put<uint64_t>(p, 48, r.thread_id); put<int64_t>(p, 56, r.created);
    put<int64_t>(p, 64, r.started); put<int64_t>(p, 72, r.completed);
    std::memset(p + 80, 0, kName);
    std::memcpy(p + 80, name.data(), std::min(name.size(), kName - 1));
    std::memset(p + 128, 0, 2 * kTensors + 2 * kTensors * kDims * 8 + 2 * kTensors * kDtype);
    side(p, 0, r.in);
    if (r.has_out) side(p, 1, r.out);
    end_write(p);
  }

  template <typename R>
  void progress(const R& r) {  // state and times only
    uint8_t* p = begin_write(r.record_id);
    if (p == nullptr) return;
    p[4] = r.state;
    put<int64_t>(p, 64, r.started); put<int64_t>(p, 72, r.completed);
    end_write(p);
  }

 private:
  template <typename T>
  static void put(uint8_t* p, size_t at, T v) { std::memcpy(p + at, &v, sizeof v); }

  // The sequence word is odd while the record is written: a death mid-write leaves it odd, and
  // the reader passes the record over. Signal fences keep the compiler from moving the stores
  // across it (a death, not another thread, is the reader to guard against).
  uint8_t* begin_write(int64_t rid) {
    if (base_ == nullptr || capacity_ == 0) return nullptr;
    uint8_t* p = base_ + records_at_ + (static_cast<size_t>(rid) % capacity_) * kRecordSize;
    uint32_t seq;
    std::memcpy(&seq, p, 4);
    seq |= 1;
    std::memcpy(p, &seq, 4);
    std::atomic_signal_fence(std::memory_order_seq_cst);
    return p;
  }
  static void end_write(uint8_t* p) {
    std::atomic_signal_fence(std::memory_order_seq_cst);
    uint32_t seq;
    std::memcpy(&seq, p, 4);
    seq += 1;
    std::memcpy(p, &seq, 4);
  }
  template <typename S>
  static void side(uint8_t* p, size_t which, const S& sh) {
    size_t at = 0;
    for (size_t i = 0; i < sh.ndims.size(); ++i) {
      size_t n = sh.ndims[i];
      if (i < kTensors) {
        size_t k = which * kTensors + i;
        p[128 + k] = static_cast<uint8_t>(n);
        for (size_t d = 0; d < std::min(n, kDims); ++d) {
          put<int64_t>(p, 136 + (k * kDims + d) * 8, sh.dims[at + d]);
        }
        const char* dt = c10::toString(static_cast<c10::ScalarType>(sh.dtypes[i]));
        std::memcpy(p + 392 + k * kDtype, dt, std::min(std::strlen(dt), kDtype - 1));
      }
      at += n;
    }
  }

  uint8_t* base_ = nullptr;
  size_t size_ = 0, records_at_ = 0, capacity_ = 0;
};

class Core;

// A work whose completion is seen only when wait() returns (gloo's reduce_scatter works never
// report it when polled): wait() tells the core.
class WaitReportingWork : public c10d::Work {
 public:
  WaitReportingWork(c10::intrusive_ptr<c10d::Work> inner, std::shared_ptr<Core> core,
                    int64_t rid)
      : c10d::Work(-1, inner->retrieveOpType()), inner_(std::move(inner)),
        core_(std::move(core)), rid_(rid) {}
  bool wait(std::chrono::milliseconds timeout) override;
  bool isCompleted() override { return waited_ && inner_->isCompleted(); }
  bool isSuccess() const override { return inner_->isSuccess(); }
  std::exception_ptr exception() const override { return inner_->exception(); }
  int sourceRank() const override { return inner_->sourceRank(); }
  std::vector<at::Tensor> result() override { return inner_->result(); }
  void synchronize() override { inner_->synchronize(); }
  void abort() override { inner_->abort(); }
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override { return inner_->getFuture(); }
  float getDuration() const override { return inner_->getDuration(); }
  uint64_t getSequencenumber() const override { return inner_->getSequencenumber(); }
  bool waited() const { return waited_; }

 private:
  c10::intrusive_ptr<c10d::Work> inner_;
  std::shared_ptr<Core> core_;
  int64_t rid_;
  std::atomic<bool> waited_{false};
};

class Core : public std::enable_shared_from_this<Core> {
 public:
  // is_library(filename) -> bool: a file of torch, the standard library or tether's own;
  // walk_on: how far past stack_depth a stack is walked for the first other frame (both as
  // recorder/frames.py's capture); p2p_seq_base: where p2p sequence numbers start
  // (events/schema.P2P_SEQ_BASE); ring_path: the ring file (empty: none), whose records start
  // at records_at.
  Core(size_t capacity, int stack_depth, py::object is_library, int walk_on,
       int64_t p2p_seq_base, const std::string& ring_path, size_t records_at)
      : ring_(capacity), stack_depth_(stack_depth), walk_on_(walk_on),
        is_library_(std::move(is_library)), p2p_seq_base_(p2p_seq_base),
        file_(ring_path, records_at, capacity) {}

  bool ring_file_open() const { return file_.open(); }

  ~Core() {
    // At interpreter exit Python may be gone already: leak the callable (and the code
    // table's references) rather than crash.
    is_library_.release();
  }

  int32_t add_group(int32_t rank) {
    std::lock_guard<std::mutex> g(mu_);
    Group grp;
    grp.uid = static_cast<int32_t>(groups_.size());
    grp.rank = rank;
    grp.p2p_seq = p2p_seq_base_;
    grp.reports.assign(N_OPS, -1);
    groups_.push_back(std::move(grp));
    return groups_.back().uid;
  }

  // -- the issue path (no GIL held; takes it only to capture the stack) -------------------------
  // Record an operation as it is issued (state "scheduled"); -1 where recording it failed: a
  // recorder bug never fails the user's collective.
  template <typename Fill>
  int64_t begin(int32_t gid, Op op, const std::string& backend, int peer, Fill&& fill) noexcept {
    try {
      return begin_(gid, op, backend, peer, fill);
    } catch (const std::exception& e) {
      bug("recording an operation", e.what());
      return -1;
    }
  }

  template <typename Fill>
  int64_t begin_(int32_t gid, Op op, const std::string& backend, int peer, Fill& fill) {
    if (fail_record_ > 0 && fail_record_-- > 0) throw std::runtime_error("a recorder bug (injected)");
    thread_local std::vector<FrameRef> frames;
    capture(frames);
    std::vector<c10::intrusive_ptr<c10d::Work>> dead;  // dropped after unlocking
    int64_t rid;
    {
      std::lock_guard<std::mutex> g(mu_);
      Group& grp = groups_[gid];
      grp.op_id += 1;
      // Inside a coalescing block only its first operation advances a counter: torch numbers
      // the block's operations, and the "coalesced" entry that ends it, alike.
      bool advance = !grp.coalescing || grp.coalesced.empty();
      bool p2p = op == SEND || op == RECV || op == RECV_ANYSOURCE;
      if (p2p) grp.p2p_seq += advance; else grp.seq += advance;
      rid = next_id_++;
      Rec& r = slot(rid, dead);
      r.record_id = rid; r.group = gid; r.op = op; r.state = SCHEDULED;
      r.is_p2p = p2p; r.me = grp.rank; r.peer = peer;
      r.seq = grp.seq; r.p2p_seq = grp.p2p_seq; r.op_id = grp.op_id;
      r.thread_id = static_cast<uint64_t>(pthread_self());
      r.created = now_ns(); r.started = 0; r.completed = 0;
      r.in.clear(); r.out.clear(); r.has_out = false; r.error.clear();
      r.backend = backend;
      fill(r);
      r.frames.assign(frames.begin(), frames.end());  // into the slot's kept capacity
      if (grp.coalescing) grp.coalesced.push_back(rid);
      if (file_.open()) file_.full(r, name_of(r));
    }
    return rid;
  }

  void start_coalescing(int32_t gid) {
    std::lock_guard<std::mutex> g(mu_);
    groups_[gid].coalescing = true;
    groups_[gid].coalesced.clear();
  }

  // The entry closing a coalescing block ("<backend>:coalesced"); -1 if the block was empty.
  int64_t end_coalescing(int32_t gid) {
    std::vector<c10::intrusive_ptr<c10d::Work>> dead;  // dropped after unlocking
    int64_t rid = -1;
    {
      std::lock_guard<std::mutex> g(mu_);
      Group& grp = groups_[gid];
      std::vector<int64_t> ops;
      ops.swap(grp.coalesced);
      grp.coalescing = false;
      if (ops.empty()) return -1;
      const Rec* first = find(ops[0]);
      grp.op_id += 1;
      rid = next_id_++;
      Rec copy_of_first;
      if (first != nullptr) {
        copy_of_first.seq = first->seq; copy_of_first.p2p_seq = first->p2p_seq;
        copy_of_first.is_p2p = first->is_p2p; copy_of_first.backend = first->backend;
        copy_of_first.frames = first->frames;
      }
      Rec& r = slot(rid, dead);
      r.record_id = rid; r.group = gid; r.op = COALESCED; r.state = SCHEDULED;
      r.is_p2p = copy_of_first.is_p2p; r.me = grp.rank; r.peer = -1;
      r.seq = first ? copy_of_first.seq : grp.seq;
      r.p2p_seq = first ? copy_of_first.p2p_seq : grp.p2p_seq;
      r.op_id = grp.op_id;
      r.thread_id = static_cast<uint64_t>(pthread_self());
      r.created = now_ns(); r.started = 0; r.completed = 0;
      r.in.clear(); r.out.clear(); r.has_out = false; r.error.clear();
      r.backend = copy_of_first.backend;
      r.frames = std::move(copy_of_first.frames);
      if (file_.open()) file_.full(r, name_of(r));
    }
    return rid;
  }

  // The backend accepted the operation: state "started"; returns the work to hand the caller.
  c10::intrusive_ptr<c10d::Work> issued(int64_t rid, c10::intrusive_ptr<c10d::Work> work) {
    if (rid < 0 || !work) return work;
    try {
      return issued_(rid, work);
    } catch (const std::exception& e) {
      bug("tracking an operation's completion", e.what());
      return work;
    }
  }

  c10::intrusive_ptr<c10d::Work> issued_(int64_t rid, c10::intrusive_ptr<c10d::Work> work) {
    if (fail_track_ > 0 && fail_track_-- > 0) throw std::runtime_error("a recorder bug (injected)");
    std::vector<c10::intrusive_ptr<c10d::Work>> done;  // dropped after unlocking
    {
      std::lock_guard<std::mutex> g(mu_);
      Rec* r = find(rid);
      if (r == nullptr) return work;  // evicted already (a ring smaller than one block)
      Group& grp = groups_[r->group];
      r->started = now_ns();
      r->state = STARTED;
      file_.progress(*r);
      if (!r->is_p2p) grp.last_started = r->seq;
      int8_t& reports = grp.reports[r->op];
      if (reports < 0) reports = reports_completion(work);
      if (!reports) {
        work = c10::make_intrusive<WaitReportingWork>(work, shared_from_this(), rid);
      }
      r->work = work;
      drain(grp, r->started, 0, done);  // the previous operation has usually finished by now
      grp.inflight.push_back(rid);
    }
    return work;
  }

  // A synchronous operation (monitoredBarrier returns no work): started as it is called and
  // finished when it returns; never queued, so one that throws stays started in the record.
  void started(int64_t rid) {
    std::lock_guard<std::mutex> g(mu_);
    Rec* r = find(rid);
    if (r == nullptr) return;
    r->started = now_ns();
    r->state = STARTED;
    file_.progress(*r);
    if (!r->is_p2p) groups_[r->group].last_started = r->seq;
  }

  void finish(int64_t rid) {  // completed now: its wait() returned
    std::vector<c10::intrusive_ptr<c10d::Work>> done;
    std::lock_guard<std::mutex> g(mu_);
    Rec* r = find(rid);
    if (r != nullptr && r->state != COMPLETED) complete(*r, now_ns(), done);
  }

  // -- what Python asks (the watchdog with the GIL released; dumps with it held) ----------------
  void reap(int64_t min_age_ns) {
    std::vector<c10::intrusive_ptr<c10d::Work>> done;
    {
      std::lock_guard<std::mutex> g(mu_);
      int64_t now = now_ns();
      for (auto& grp : groups_) drain(grp, now, min_age_ns, done);
      std::vector<int64_t> still;
      for (auto rid : parked_) {
        Rec* r = find(rid);
        if (r != nullptr && !poll(*r, now, done)) still.push_back(rid); else retire(rid);
      }
      parked_.swap(still);
    }
  }

  // Record ids of every operation still in flight (polled first), oldest first.
  std::vector<int64_t> inflight() {
    std::vector<c10::intrusive_ptr<c10d::Work>> done;
    std::vector<int64_t> out;
    {
      std::lock_guard<std::mutex> g(mu_);
      int64_t now = now_ns();
      auto visit = [&](int64_t rid) {
        Rec* r = find(rid);
        if (r != nullptr && !poll(*r, now, done)) out.push_back(rid);
      };
      for (auto& grp : groups_) for (auto rid : grp.inflight) visit(rid);
      for (auto rid : parked_) visit(rid);
    }
    std::sort(out.begin(), out.end());
    return out;
  }

  // The oldest operation not known to be completed (queue heads and parked ones only); -1: none.
  int64_t oldest_inflight() {
    std::lock_guard<std::mutex> g(mu_);
    int64_t best = -1, best_t = 0;
    auto visit = [&](int64_t rid) {
      const Rec* r = find(rid);
      if (r != nullptr && (best < 0 || r->created < best_t)) { best = rid; best_t = r->created; }
    };
    for (auto& grp : groups_) if (!grp.inflight.empty()) visit(grp.inflight.front());
    for (auto rid : parked_) visit(rid);
    return best;
  }

  // Keep the group's entries now in the ring past their eviction (the group looks stuck).
  std::vector<int64_t> suspect(int32_t gid) {
    std::lock_guard<std::mutex> g(mu_);
    std::vector<int64_t> out;
    for (auto& r : ring_) {
      if (r.in_use && r.group == gid) { r.pinned = true; out.push_back(r.record_id); }
    }
    return out;
  }

  // Entries as tuples (see native.py's _FIELDS), oldest first: the ring, then kept ones.
  py::list snapshot(const std::vector<int64_t>& only) {
    std::vector<Rec> copies;
    {
      std::lock_guard<std::mutex> g(mu_);
      if (only.empty()) {
        for (auto& r : ring_) if (r.in_use) copies.push_back(copy(r));
        for (auto& kv : kept_) copies.push_back(copy(kv.second));
        // Operations still in flight that newer ones pushed out of the ring: a dump drops an
        // operation only once it completed (the one a hang is about must be there).
        for (auto& kv : aside_) if (!kept_.count(kv.first)) copies.push_back(copy(kv.second));
      } else {
        for (auto rid : only) if (const Rec* r = find(rid)) copies.push_back(copy(*r));
      }
    }
    std::sort(copies.begin(), copies.end(),
              [](const Rec& a, const Rec& b) { return a.record_id < b.record_id; });
    py::list out;
    for (auto& r : copies) out.append(as_tuple(r));
    return out;
  }

  // The group was reconfigured (torch 2.14+): this process is now `rank` of a new communicator,
  // whose sequence numbers start again, as torch restarts its own. Operations still in flight
  // stay queued: they belong to the communicator before.
  void regroup(int32_t gid, int32_t rank) {
    std::lock_guard<std::mutex> g(mu_);
    Group& grp = groups_[gid];
    grp.rank = rank;
    grp.seq = grp.op_id = grp.last_started = grp.last_completed = 0;
    grp.p2p_seq = p2p_seq_base_;
  }

  py::tuple group_status(int32_t gid) {
    std::lock_guard<std::mutex> g(mu_);
    Group& grp = groups_[gid];
    return py::make_tuple(grp.seq, grp.last_started, grp.last_completed, grp.p2p_seq, grp.op_id);
  }

  // The operation that finished last in the group, with its work (None, None: none).
  py::tuple last_done(int32_t gid) {
    c10::intrusive_ptr<c10d::Work> work;
    int64_t rid;
    {
      std::lock_guard<std::mutex> g(mu_);
      rid = groups_[gid].last_done;
      work = groups_[gid].last_done_work;
    }
    if (rid < 0 || !work) return py::make_tuple(py::none(), py::none());
    return py::make_tuple(rid, py::cast(work));
  }

  void forget_last_done(int32_t gid, int64_t rid) {
    c10::intrusive_ptr<c10d::Work> drop;
    std::lock_guard<std::mutex> g(mu_);
    Group& grp = groups_[gid];
    if (grp.last_done == rid) { grp.last_done = -1; drop = std::move(grp.last_done_work); }
  }

  void mark_failed(int64_t rid, const std::string& error) {
    std::lock_guard<std::mutex> g(mu_);
    if (Rec* r = find(rid)) {
      r->error = error; r->state = STARTED; r->completed = 0;
      file_.progress(*r);
    }
  }

  // The backend raised as the operation was issued: it never ran. Its record stays "scheduled",
  // with the error (a dump counts it retired, in its `failed`).
  void refused(int64_t rid, const char* error) {
    std::lock_guard<std::mutex> g(mu_);
    if (Rec* r = find(rid)) r->error = std::string(error).substr(0, 300);
  }

  size_t capacity() const { return ring_.size(); }
  // The recorder bugs since the last call ("what: why"), for Python to log.
  py::list bugs() {
    std::vector<std::string> taken;
    {
      std::lock_guard<std::mutex> g(mu_);
      taken.swap(bugs_);
    }
    py::list out;
    for (auto& b : taken) out.append(b);
    return out;
  }
  // Tests: make the next n recordings ("record") or completion trackings ("track") fail.
  void fail_next(const std::string& what, int n) {
    (what == "record" ? fail_record_ : fail_track_) = n;
  }
  void set_stack_depth(int depth) { stack_depth_ = depth; }

 private:
  // gloo completes a work's future before the work itself (AsyncWork::finishWorkGloo), so a
  // caller that waited on the future (DDP's reducer) runs on while isCompleted() still says no:
  // after ~0.5% of 3000 DDP steps on a loaded 2-core machine, for up to 20 ms. A done future on
  // no device means the operation is done; a device future (nccl's) completes at launch.
  static bool future_done(c10d::Work& work) {
    try {
      auto future = work.getFuture();
      return future && future->completed() && future->devices().empty();
    } catch (...) {  // a work without a future: its isCompleted() alone says
      return false;
    }
  }

  static int8_t reports_completion(const c10::intrusive_ptr<c10d::Work>& work) {
    try {
      work->getFuture();
      return 1;
    } catch (...) {
      return 0;
    }
  }

  // The ring slot for a new record id; an evicted entry is kept aside if pinned.
  // `dead` takes the works released meanwhile, to drop after unlocking.
  Rec& slot(int64_t rid, std::vector<c10::intrusive_ptr<c10d::Work>>& dead) {
    Rec& r = ring_[static_cast<size_t>(rid) % ring_.size()];
    if (r.in_use) {
      if (r.pinned) {
        Rec kept = copy(r);
        kept.work = std::move(r.work);
        kept_.emplace(kept.record_id, std::move(kept));
      } else if (r.state != COMPLETED && r.work) {
        // Still in flight: the watchdog and dumps go on seeing it until it completes.
        Rec aside = copy(r);
        aside.work = std::move(r.work);
        aside_.emplace(aside.record_id, std::move(aside));
      }
    }
    if (!graveyard_.empty()) dead.swap(graveyard_);  // works retired by the watchdog
    if (r.work) dead.push_back(std::move(r.work));
    r.in_use = true;
    r.pinned = false;
    return r;
  }

  const Rec* find(int64_t rid) const {
    if (rid < 0) return nullptr;
    const Rec& r = ring_[static_cast<size_t>(rid) % ring_.size()];
    if (r.in_use && r.record_id == rid) return &r;
    auto it = kept_.find(rid);
    if (it != kept_.end()) return &it->second;
    auto at = aside_.find(rid);
    return at == aside_.end() ? nullptr : &at->second;
  }

  // A completed operation that had left the ring is forgotten (the caller holds the mutex).
  void retire(int64_t rid) {
    auto at = aside_.find(rid);
    if (at == aside_.end() || at->second.state != COMPLETED) return;
    if (at->second.work) graveyard_.push_back(std::move(at->second.work));
    aside_.erase(at);
  }
  Rec* find(int64_t rid) { return const_cast<Rec*>(static_cast<const Core*>(this)->find(rid)); }

  bool poll(Rec& r, int64_t now, std::vector<c10::intrusive_ptr<c10d::Work>>& done) {
    if (r.state == COMPLETED) return true;
    bool finished, failed = false;
    if (!r.work) {
      finished = true;
    } else if (auto* w = dynamic_cast<WaitReportingWork*>(r.work.get())) {
      finished = w->waited();
    } else {
      try {
        finished = r.work->isCompleted() || future_done(*r.work);
        failed = finished && static_cast<bool>(r.work->exception());
      } catch (...) {  // a failed work is finished too; its error is the dump's to ask
        finished = failed = true;
      }
    }
    if (finished) complete(r, now, done, failed);
    return finished;
  }

  // `failed`: the ring file keeps the operation started, as a dump shows a failed one: a rank
  // that dies of the failure (a peer's death) must not look, recovered, as if it completed.
  void complete(Rec& r, int64_t now, std::vector<c10::intrusive_ptr<c10d::Work>>& done,
                bool failed = false) {
    if (failed) file_.progress(r);  // still STARTED, no completion time: filed as such
    r.state = COMPLETED;
    r.completed = now;
    if (!failed) file_.progress(r);
    Group& grp = groups_[r.group];
    grp.last_done = r.record_id;
    if (grp.last_done_work) done.push_back(std::move(grp.last_done_work));
    grp.last_done_work = std::move(r.work);
    if (!r.is_p2p && r.seq > grp.last_completed) grp.last_completed = r.seq;
  }

  void drain(Group& grp, int64_t now, int64_t min_age,
             std::vector<c10::intrusive_ptr<c10d::Work>>& done) {
    while (!grp.inflight.empty()) {
      Rec* head = find(grp.inflight.front());
      if (head == nullptr) { grp.inflight.pop_front(); continue; }  // evicted
      if (now - head->created < min_age) return;
      int64_t rid = head->record_id;
      if (!poll(*head, now, done)) {
        if (grp.inflight.size() <= kParkAfter) return;
        parked_.push_back(rid);
      } else {
        retire(rid);
      }
      grp.inflight.pop_front();
    }
  }

  // The issuing thread's Python stack, innermost first, as recorder/frames.py's capture keeps
  // it: stack_depth_ frames and, past them, when the outermost kept is a library's, the first
  // frame that is not (after an elision marker). Only a thread that runs Python has one (DDP's
  // autograd thread on GPU has none). No GIL: only this thread changes its frames, and while it
  // is in here they hold still, each holding its code. The GIL is taken only for a code object
  // the table has not met yet (to hold it, and to ask Python whether it is a library's).
  void capture(std::vector<FrameRef>& out) {
    out.clear();
    if (stack_depth_ <= 0 || !Py_IsInitialized() || finalizing()) return;
    PyThreadState* ts = PyGILState_GetThisThreadState();
    if (ts == nullptr || ts->cframe == nullptr) return;
    if (walk(ts->cframe->current_frame, out, false)) return;
    PyGILState_STATE st = PyGILState_Ensure();
    walk(ts->cframe->current_frame, out, true);
    PyGILState_Release(st);
  }

  static _PyInterpreterFrame* complete_frame(_PyInterpreterFrame* f) {
    while (f != nullptr && _PyFrame_IsIncomplete(f)) f = f->previous;  // not started yet
    return f;
  }

  // False (out cleared) at a code object the table lacks, unless `gil`: then it is added.
  bool walk(_PyInterpreterFrame* f, std::vector<FrameRef>& out, bool gil) {
    out.clear();
    int8_t verdict = CodeTable::UNKNOWN;
    auto known = [&](PyCodeObject* code) {
      verdict = codes_.get(code);
      if (verdict == CodeTable::UNKNOWN && gil) verdict = meet(code);
      return verdict != CodeTable::UNKNOWN;
    };
    // At a code object the table lacks: without the GIL, give up (the caller walks again
    // with it); with it, the table is full, and the stack ends where it can be held.
    auto missing = [&] {
      if (!gil) out.clear();
      return gil;
    };
    auto lasti = [](_PyInterpreterFrame* g) {
      return static_cast<int32_t>(_PyInterpreterFrame_LASTI(g) * sizeof(_Py_CODEUNIT));
    };
    f = complete_frame(f);
    for (int depth = stack_depth_; f != nullptr && depth > 0; --depth) {
      if (!known(f->f_code)) return missing();
      out.push_back({f->f_code, lasti(f)});
      f = complete_frame(f->previous);
    }
    if (f == nullptr || verdict != CodeTable::LIBRARY) return true;
    for (int32_t passed = 0; f != nullptr && passed < walk_on_; ++passed) {
      if (!known(f->f_code)) return missing();
      if (verdict == CodeTable::USER) {
        out.push_back({nullptr, passed});
        out.push_back({f->f_code, lasti(f)});
        return true;
      }
      f = complete_frame(f->previous);
    }
    return true;
  }

  // The GIL is held: hold `code` and classify it; UNKNOWN when the table is full.
  int8_t meet(PyCodeObject* code) {
    int8_t verdict = codes_.get(code);  // another thread may have met it meanwhile
    if (verdict != CodeTable::UNKNOWN) return verdict;
    PyObject* r = PyObject_CallFunctionObjArgs(is_library_.ptr(), code->co_filename, nullptr);
    bool library = r != nullptr && PyObject_IsTrue(r) == 1;
    if (r == nullptr) PyErr_Clear();
    Py_XDECREF(r);
    if (!codes_.add(code, library)) {
      if (!codes_full_.exchange(true)) {
        bug("keeping a stack", ("the code table is full (" + std::to_string(CodeTable::kMax) +
                                " code objects): stacks end at code first met after it filled")
                                   .c_str());
      }
      return CodeTable::UNKNOWN;
    }
    return library ? CodeTable::LIBRARY : CodeTable::USER;
  }

  static Rec copy(const Rec& r) {  // under the mutex: all but the work
    Rec c = r;
    c.work.reset();
    return c;
  }

  // "<backend>:<op>", p2p with " <me>-><peer>" or " <me><-<peer>": torch's profiling name.
  static std::string name_of(const Rec& r) {
    std::string name = r.backend;
    name += ':';
    name += kName[r.op];
    if (r.op == SEND || r.op == RECV || r.op == RECV_ANYSOURCE) {
      char buf[32];
      char* end = std::to_chars(buf, buf + 12, r.me).ptr;
      const char* arrow = r.op == SEND ? "->" : "<-";
      *end++ = arrow[0];
      *end++ = arrow[1];
      end = std::to_chars(end, buf + sizeof buf, r.peer).ptr;
      name += ' ';
      name.append(buf, end);
    }
    return name;
  }

  static py::tuple as_tuple(const Rec& r) {
    std::string name = name_of(r);
    static const char* const kState[] = {"scheduled", "started", "completed"};
    py::object frames = py::none();
    if (!r.frames.empty()) {  // frames.capture's format: (code, lasti, ..., None, passed, ...)
      py::tuple t(2 * r.frames.size());
      size_t i = 0;
      for (const FrameRef& f : r.frames) {
        t[i++] = f.code ? py::reinterpret_borrow<py::object>(reinterpret_cast<PyObject*>(f.code))
                        : py::none();
        t[i++] = py::int_(f.lasti);
      }
      frames = std::move(t);
    }
    py::object out_sizes = r.has_out ? py::object(r.out.sizes()) : py::none();
    py::object out_dtypes = r.has_out ? py::object(r.out.dtype_names()) : py::none();
    py::object error = r.error.empty() ? py::none() : py::object(py::str(r.error));
    return py::make_tuple(
        r.record_id, r.group, kMethod[r.op], name, r.seq, r.p2p_seq, r.op_id,
        r.is_p2p, r.in.sizes(), r.in.dtype_names(), out_sizes, out_dtypes, frames, r.thread_id,
        r.created, r.started, r.completed, kState[r.state], error);
  }

  // Told to Python (which logs each kind once) when it next asks: no logging from here.
  void bug(const char* what, const char* why) {
    std::lock_guard<std::mutex> g(mu_);
    if (bugs_.size() < 16) bugs_.push_back(std::string(what) + ": " + why);
  }

  std::mutex mu_;
  std::vector<std::string> bugs_;
  std::atomic<int> fail_record_{0}, fail_track_{0};
  std::vector<Rec> ring_;
  std::map<int64_t, Rec> kept_;   // pinned entries evicted from the ring (dumped)
  std::map<int64_t, Rec> aside_;  // in-flight entries evicted from the ring (watched)
  std::vector<Group> groups_;
  std::vector<int64_t> parked_;
  std::vector<c10::intrusive_ptr<c10d::Work>> graveyard_;  // released under the mutex
  int64_t next_id_ = 0;
  int stack_depth_;
  int walk_on_;
  py::object is_library_;
  CodeTable codes_;
  std::atomic<bool> codes_full_{false};
  int64_t p2p_seq_base_;
  RingFile file_;
};

bool WaitReportingWork::wait(std::chrono::milliseconds timeout) {
  bool ok = inner_->wait(timeout);
  if (!waited_.exchange(true)) core_->finish(rid_);
  return ok;
}

// The recording backend: one per process group, over each device's real backend.
class RecordingBackend : public c10d::Backend {
 public:
  RecordingBackend(std::shared_ptr<Core> core, int32_t gid, int rank, int size,
                   std::vector<std::tuple<std::string, c10::intrusive_ptr<c10d::Backend>,
                                          std::string>> inners,
                   const std::string& default_device)
      : c10d::Backend(rank, size), core_(std::move(core)), gid_(gid) {
    for (auto& [device, backend, name] : inners) {
      auto type = c10::Device(device).type();
      inners_.emplace_back(type, backend, name);
      if (device == default_device || !default_) default_ = backend;
    }
    // torch named the backends before we wrapped them: the group's name is read from its
    // backend (ProcessGroup::getGroupName), and names resolve functional collectives' groups.
    c10d::Backend::setGroupUid(default_->getGroupUid());
    setGroupDesc(default_->getGroupDesc());
    setBoundDeviceId(default_->getBoundDeviceId());
  }

  const std::string getBackendName() const override { return default_->getBackendName(); }
  c10::intrusive_ptr<c10d::Backend> inner(const std::string& device) const {
    if (device.empty()) return default_;
    auto type = c10::Device(device).type();
    for (auto& [t, b, n] : inners_) if (t == type) return b;
    return default_;
  }

  bool supportsSplitting() const override { return default_->supportsSplitting(); }
  bool supportsCoalescing() const override { return default_->supportsCoalescing(); }
  void setTimeout(std::chrono::milliseconds t) override { for (auto& i : inners_) i.b->setTimeout(t); }
  c10::intrusive_ptr<Options> getBackendOptions() override { return default_->getBackendOptions(); }
  void setGroupUid(const std::string& uid) override {
    c10d::Backend::setGroupUid(uid);
    for (auto& i : inners_) i.b->setGroupUid(uid);
  }
  void eagerConnectSingleDevice(at::Device d) override { pick(d.type()).b->eagerConnectSingleDevice(d); }
  c10d::ErrorType getError() override { return default_->getError(); }
  void abort() override { for (auto& i : inners_) i.b->abort(); }
  void shutdown() override { for (auto& i : inners_) i.b->shutdown(); }
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override {
    auto& chosen = pick(c10::DeviceType::CPU);  // torch dispatches it to the CPU backend (gloo)
    if (!attached()) return chosen.b->monitoredBarrier(o, wait_all);
    int64_t rid = core_->begin(gid_, MONITORED_BARRIER, chosen.name, -1, [](Rec&) {});
    check_ready();
    core_->started(rid);
    chosen.b->monitoredBarrier(o, wait_all);
    core_->finish(rid);
  }
  void setSequenceNumberForGroup() override { default_->setSequenceNumberForGroup(); }
  uint64_t getSequenceNumberForGroup() override { return default_->getSequenceNumberForGroup(); }
  void registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override {
    default_->registerOnCompletionHook(std::move(hook));
  }
  void waitForPendingWorks() override { default_->waitForPendingWorks(); }
#ifdef C10D_BACKEND_HAS_RECONFIGURE  // torch 2.14+
  bool supportsReconfigure() const override { return default_->supportsReconfigure(); }
  c10d::ReconfigureHandle get_reconfigure_handle() const override {
    return default_->get_reconfigure_handle();
  }
  // The wrapped backend's own reconfigure; then this group is what it became (torch reads a
  // group's rank and size from its backend after a reconfigure).
  c10::intrusive_ptr<c10d::Work> reconfigure(const c10d::ReconfigureOptions& o) override {
    auto work = default_->reconfigure(o);
    rank_ = default_->getRank();
    size_ = default_->getSize();
    if (attached()) core_->regroup(gid_, rank_);
    return work;
  }
#endif
  void enableCollectivesTiming() override { for (auto& i : inners_) i.b->enableCollectivesTiming(); }

  // What else torch calls on a group's backend, answered by the backend wrapped here: a method
  // left to c10d::Backend's default would refuse ("Backend ... is missing implementation of
  // split") where the group's own backend does it. A group split or merged from a recorded one
  // gets the wrapped backend's child; tether/recorder/patch.py records the new group as it
  // records any other.
  //
  // torch registers a split's or a merge's child in the new group under the parent's backend
  // type for the device (ours, CUSTOM), so the child must be a recording backend too: it passes
  // operations through unrecorded until tether/recorder/native.py attaches it to its group.
  // A shrink's child goes to a group torch builds afresh, which tether wraps like any other.
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override {
    auto& inner = by_options(opts);
    return derived(inner, inner.b->split(store, ranks, opts));
  }
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts,
                                          const int& rank, const int& size) override {
    auto& inner = by_options(opts);
    return derived(inner, inner.b->merge(store, opts, rank, size));
  }
  bool supportsShrinking() const override { return default_->supportsShrinking(); }
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude,
                                           int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts) override {
    return by_options(opts).b->shrink(ranks_to_exclude, shrink_flags, opts);
  }
  bool supportsTimeEstimation() const override { return default_->supportsTimeEstimation(); }
  std::shared_ptr<c10::Allocator> getMemAllocator() override { return default_->getMemAllocator(); }
  at::Tensor allocateTensor(long size, at::TensorOptions options) override {
    return default_->allocateTensor(size, options);
  }
  bool supportsTensorAlloc(c10::DeviceIndex index) override {
    return default_->supportsTensorAlloc(index);
  }
  void suspend() override { for (auto& i : inners_) i.b->suspend(); }
  void resume() override { for (auto& i : inners_) i.b->resume(); }
  std::unordered_map<std::string, uint64_t> getMemoryStats() override {
    return default_->getMemoryStats();
  }
#if TETHER_TORCH_AT_LEAST(2, 14)
  void addEphemeralTimeout(const std::chrono::milliseconds& t) override {
    for (auto& i : inners_) i.b->addEphemeralTimeout(t);
  }
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override {
    default_->registerAbortHook(id, std::move(hook));
  }
  void unregisterAbortHook(int64_t id) override { default_->unregisterAbortHook(id); }
  c10::intrusive_ptr<c10d::Work> gather_single(at::Tensor& out, at::Tensor& in,
                                               const c10d::GatherOptions& o) override {
    return pick(in.device().type()).b->gather_single(out, in, o);  // unrecorded, as allreduce_sparse
  }
#endif
#ifdef C10D_BACKEND_HAS_WINDOW  // torch 2.14+
  bool supportsWindow() const override { return default_->supportsWindow(); }
  c10::intrusive_ptr<c10d::Window> new_window(const std::optional<at::Tensor>& t) override {
    return default_->new_window(t);
  }
#endif
#if TETHER_TORCH_AT_LEAST(2, 15)
  bool isInitialized() override { return default_->isInitialized(); }
  void startTimeEstimate() override { default_->startTimeEstimate(); }
  float endTimeEstimate() override { return default_->endTimeEstimate(); }
  bool supportsAbortHooks() const override { return default_->supportsAbortHooks(); }
  bool supportsCompletionHooks() const override { return default_->supportsCompletionHooks(); }
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override {
    default_->registerCompletionHook(id, std::move(hook));
  }
  void unregisterCompletionHook(int64_t id) override { default_->unregisterCompletionHook(id); }
#endif

  // torch 2.13 has no reconfigure; tether's (tether/recorder/reconfigure.py) keeps a group
  // created with enable_reconfigure unready until its first reconfigure, as torch 2.14's gloo
  // does, then puts each new communicator's backend in place of the one wrapped here. The
  // caller issues nothing on the group meanwhile (torch's contract for reconfigure too).
  void set_ready(bool ready) { ready_.store(ready, std::memory_order_relaxed); }
  bool attached() const { return gid_ != kUnattached; }
  void attach(int32_t gid) {
    TORCH_CHECK(!attached(), "this recording backend already records group ", gid_);
    gid_ = gid;
  }
  void replace(const c10::intrusive_ptr<c10d::Backend>& backend, int rank, int size) {
    for (auto& i : inners_) {  // gloo serves both CPU and CUDA tensors: one backend, twice
      TORCH_CHECK(i.b.get() == default_.get(), "a group of several backends cannot be replaced");
    }
    backend->setGroupUid(getGroupUid());
    backend->setGroupDesc(getGroupDesc());
    for (auto& i : inners_) i.b = backend;
    default_ = backend;
#ifdef C10D_BACKEND_HAS_RECONFIGURE  // before 2.14 a backend's rank and size are constant
    rank_ = rank;
    size_ = size;
#else
    (void)size;
#endif
    if (attached()) core_->regroup(gid_, rank);
    set_ready(true);
  }

// A `try` costs nothing until something raises. The attached() test is one predictable branch
// on a member this call reads anyway (gid_); it lets a split's child pass operations through
// until its group is known, instead of a second backend class for that one moment.
#define TETHER_RECORD(OP, DEVICE, PEER, FILL, CALL)                                         \
  auto& chosen = pick(DEVICE);                                                             \
  if (!attached()) return chosen.b->CALL;                                                  \
  int64_t rid = core_->begin(gid_, OP, chosen.name, PEER, [&](Rec& r) { FILL; });          \
  c10::intrusive_ptr<c10d::Work> work;                                                     \
  try {                                                                                    \
    check_ready();                                                                         \
    work = chosen.b->CALL;                                                                 \
  } catch (const c10::Error& e) {                                                          \
    core_->refused(rid, e.what_without_backtrace());                                       \
    throw;                                                                                 \
  } catch (const std::exception& e) {                                                      \
    core_->refused(rid, e.what());                                                         \
    throw;                                                                                 \
  }                                                                                        \
  return core_->issued(rid, std::move(work));

  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t, const c10d::BroadcastOptions& o) override {
    TETHER_RECORD(BROADCAST, dev(t), -1, r.in.add(t), broadcast(t, o))
  }
  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    TETHER_RECORD(ALLREDUCE, dev(t), -1, r.in.add(t), allreduce(t, o))
  }
  c10::intrusive_ptr<c10d::Work> allreduce_sparse(std::vector<at::Tensor>& t, const c10d::AllreduceOptions& o) override {
    return pick(dev(t)).b->allreduce_sparse(t, o);  // unrecorded, as on the Python path
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions& o) override {
    TETHER_RECORD(ALLREDUCE_COALESCED, dev(t), -1, r.in.add(t), allreduce_coalesced(t, o))
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t, const c10d::ReduceOptions& o) override {
    TETHER_RECORD(REDUCE, dev(t), -1, r.in.add(t), reduce(t, o))
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) override {
    TETHER_RECORD(ALLGATHER, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), allgather(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override {
    TETHER_RECORD(ALLGATHER_BASE, in.device().type(), -1, (r.in.add(in), r.out.add(out), r.has_out = true), _allgather_base(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> allgather_coalesced(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) override {
    TETHER_RECORD(ALLGATHER_COALESCED, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), allgather_coalesced(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> allgather_into_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllgatherOptions& o) override {
    TETHER_RECORD(ALLGATHER_INTO_TENSOR_COALESCED, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), allgather_into_tensor_coalesced(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> gather(std::vector<std::vector<at::Tensor>>& out, std::vector<at::Tensor>& in, const c10d::GatherOptions& o) override {
    TETHER_RECORD(GATHER, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), gather(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in, const c10d::ScatterOptions& o) override {
    TETHER_RECORD(SCATTER, dev(out), -1, (r.in.add(in), r.out.add(out), r.has_out = true), scatter(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter(std::vector<at::Tensor>& out, std::vector<std::vector<at::Tensor>>& in, const c10d::ReduceScatterOptions& o) override {
    TETHER_RECORD(REDUCE_SCATTER, dev(out), -1, (r.in.add(in), r.out.add(out), r.has_out = true), reduce_scatter(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in, const c10d::ReduceScatterOptions& o) override {
    TETHER_RECORD(REDUCE_SCATTER_BASE, in.device().type(), -1, (r.in.add(in), r.out.add(out), r.has_out = true), _reduce_scatter_base(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> reduce_scatter_tensor_coalesced(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::ReduceScatterOptions& o) override {
    TETHER_RECORD(REDUCE_SCATTER_TENSOR_COALESCED, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), reduce_scatter_tensor_coalesced(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os, std::vector<int64_t>& is, const c10d::AllToAllOptions& o) override {
    TETHER_RECORD(ALLTOALL_BASE, in.device().type(), -1, (r.in.add(in), r.out.add(out), r.has_out = true), alltoall_base(out, in, os, is, o))
  }
  c10::intrusive_ptr<c10d::Work> alltoall(std::vector<at::Tensor>& out, std::vector<at::Tensor>& in, const c10d::AllToAllOptions& o) override {
    TETHER_RECORD(ALLTOALL, dev(in), -1, (r.in.add(in), r.out.add(out), r.has_out = true), alltoall(out, in, o))
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions& o) override {
    auto device = o.device.has_value() ? o.device->type() : default_type();
    TETHER_RECORD(BARRIER, device, -1, (void)r, barrier(o))
  }
  c10::intrusive_ptr<c10d::Work> send(std::vector<at::Tensor>& t, int dst, int tag) override {
    TETHER_RECORD(SEND, dev(t), dst, r.in.add(t), send(t, dst, tag))
  }
  c10::intrusive_ptr<c10d::Work> recv(std::vector<at::Tensor>& t, int src, int tag) override {
    TETHER_RECORD(RECV, dev(t), src, r.in.add(t), recv(t, src, tag))
  }
  c10::intrusive_ptr<c10d::Work> recvAnysource(std::vector<at::Tensor>& t, int tag) override {
    TETHER_RECORD(RECV_ANYSOURCE, dev(t), -1, r.in.add(t), recvAnysource(t, tag))
  }
#undef TETHER_RECORD

  void startCoalescing() override {
    if (attached()) core_->start_coalescing(gid_);
    default_->startCoalescing();
  }
  c10::intrusive_ptr<c10d::Work> endCoalescing() override {
    if (!attached()) return default_->endCoalescing();
    int64_t rid = core_->end_coalescing(gid_);
    return core_->issued(rid, default_->endCoalescing());
  }

 private:
  struct Inner {
    c10::DeviceType type;
    c10::intrusive_ptr<c10d::Backend> b;
    std::string name;
    Inner(c10::DeviceType t, c10::intrusive_ptr<c10d::Backend> be, std::string n)
        : type(t), b(std::move(be)), name(std::move(n)) {}
  };
  static c10::DeviceType dev(const std::vector<at::Tensor>& t) {
    return t.empty() ? c10::DeviceType::CPU : t[0].device().type();
  }
  static c10::DeviceType dev(const std::vector<std::vector<at::Tensor>>& t) {
    for (auto& l : t) if (!l.empty()) return l[0].device().type();
    return c10::DeviceType::CPU;
  }
  // The wrapped backend an options object belongs to (a group of several backends splits each
  // with its own options); the default one when no name matches.
  const Inner& by_options(const c10::intrusive_ptr<Options>& opts) const {
    if (opts) {
      for (auto& i : inners_) if (i.b->getBackendName() == opts->backend) return i;
    }
    for (auto& i : inners_) if (i.b.get() == default_.get()) return i;
    return inners_[0];
  }
  c10::intrusive_ptr<c10d::Backend> derived(const Inner& parent,
                                            const c10::intrusive_ptr<c10d::Backend>& child) {
    if (!child) return child;  // this rank is in none of the split's groups
    std::vector<std::tuple<std::string, c10::intrusive_ptr<c10d::Backend>, std::string>> inners;
    std::string device = c10::DeviceTypeName(parent.type, /*lower_case=*/true);
    inners.emplace_back(device, child, parent.name);
    return c10::make_intrusive<RecordingBackend>(core_, kUnattached, child->getRank(),
                                                 child->getSize(), inners, device);
  }
  c10::DeviceType default_type() const {
    for (auto& i : inners_) if (i.b.get() == default_.get()) return i.type;
    return c10::DeviceType::CPU;
  }
  const Inner& pick(c10::DeviceType type) const {
    if (inners_.size() == 1) return inners_[0];
    for (auto& i : inners_) if (i.type == type) return i;
    for (auto& i : inners_) if (i.b.get() == default_.get()) return i;
    return inners_[0];
  }

  void check_ready() const {
    TORCH_CHECK(ready_.load(std::memory_order_relaxed),
                "ProcessGroupGloo has not been initialized. Call reconfigure() before issuing "
                "collectives when enable_reconfigure=True.");
  }

  static constexpr int32_t kUnattached = -1;
  std::shared_ptr<Core> core_;
  int32_t gid_;  // kUnattached until attach(): set before the group is handed to its user
  std::vector<Inner> inners_;
  c10::intrusive_ptr<c10d::Backend> default_;
  std::atomic<bool> ready_{true};
};

}  // namespace tether

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tether;
  py::module_::import("torch.distributed");  // c10d::Backend's and Work's Python types
  m.attr("ABI") = 6;  // native.py's ABI: the interface between this file and it
  m.attr("TORCH_VERSION") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
  py::class_<Core, std::shared_ptr<Core>>(m, "Core")
      .def(py::init<size_t, int, py::object, int, int64_t, const std::string&, size_t>(),
           py::arg("capacity"), py::arg("stack_depth"), py::arg("is_library"),
           py::arg("walk_on"), py::arg("p2p_seq_base"), py::arg("ring_path"), py::arg("records_at"))
      .def_property_readonly("ring_file_open", &Core::ring_file_open)
      .def("add_group", &Core::add_group)
      .def("reap", &Core::reap, py::call_guard<py::gil_scoped_release>())
      .def("inflight", &Core::inflight, py::call_guard<py::gil_scoped_release>())
      .def("oldest_inflight", &Core::oldest_inflight, py::call_guard<py::gil_scoped_release>())
      .def("suspect", &Core::suspect)
      .def("snapshot", &Core::snapshot, py::arg("only") = std::vector<int64_t>{})
      .def("group_status", &Core::group_status)
      .def("regroup", &Core::regroup)
      .def("last_done", &Core::last_done)
      .def("forget_last_done", &Core::forget_last_done)
      .def("mark_failed", &Core::mark_failed)
      .def("finish", &Core::finish, py::call_guard<py::gil_scoped_release>())
      .def("set_stack_depth", &Core::set_stack_depth)
      .def("bugs", &Core::bugs)
      .def("fail_next", &Core::fail_next)
      .def_property_readonly("capacity", &Core::capacity);
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(
      m, "RecordingBackend")
      .def(py::init<std::shared_ptr<Core>, int32_t, int, int,
                    std::vector<std::tuple<std::string, c10::intrusive_ptr<c10d::Backend>,
                                           std::string>>,
                    const std::string&>())
      .def("inner", &RecordingBackend::inner)
      .def("set_ready", &RecordingBackend::set_ready)
      .def_property_readonly("attached", &RecordingBackend::attached)
      .def("attach", &RecordingBackend::attach)
      .def("replace", &RecordingBackend::replace)
      // What torch and libraries call on a backend of a known type (gloo's
      // _set_default_timeout, NCCL's options, ...): answered by the backend it wraps.
      .def("__getattr__", [](RecordingBackend& self, const std::string& name) {
        return py::getattr(py::cast(self.inner("")), name.c_str());
      });
}
