// The core (core.h): records, counters and completion tracking, under one mutex.

#include "core.h"

#include <pthread.h>

#include <algorithm>
#include <charconv>
#include <stdexcept>

#include "backend.h"

namespace tether {

namespace {

constexpr size_t kParkAfter = 32;  // queued behind a stuck head before the head is parked

// gloo completes a work's future before the work itself (AsyncWork::finishWorkGloo), so a
// caller that waited on the future (DDP's reducer) runs on while isCompleted() still says no:
// after ~0.5% of 3000 DDP steps on a loaded 2-core machine, for up to 20 ms. A done future on
// no device means the operation is done; a device future (nccl's) completes at launch.
bool future_done(c10d::Work& work) {
  try {
    auto future = work.getFuture();
    return future && future->completed() && future->devices().empty();
  } catch (...) {  // a work without a future: its isCompleted() alone says
    return false;
  }
}

int8_t reports_completion(const c10::intrusive_ptr<c10d::Work>& work) {
  try {
    work->getFuture();
    return 1;
  } catch (...) {
    return 0;
  }
}

Rec copy(const Rec& r) {  // under the mutex: all but the work
  Rec c = r;
  c.work.reset();
  return c;
}

// "<backend>:<op>", p2p with " <me>-><peer>" or " <me><-<peer>": torch's profiling name.
std::string name_of(const Rec& r) {
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

py::tuple as_tuple(const Rec& r) {
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

}  // namespace

Core::Core(size_t capacity, int stack_depth, py::object is_library, int walk_on,
           int64_t p2p_seq_base, const std::string& ring_path, size_t records_at)
    : ring_(capacity), stacks_(stack_depth, walk_on, std::move(is_library)),
      p2p_seq_base_(p2p_seq_base), file_(ring_path, records_at, capacity) {}

int32_t Core::add_group(int32_t rank) {
  std::lock_guard<std::mutex> g(mu_);
  Group grp;
  grp.uid = static_cast<int32_t>(groups_.size());
  grp.rank = rank;
  grp.p2p_seq = p2p_seq_base_;
  grp.reports.assign(N_OPS, -1);
  groups_.push_back(std::move(grp));
  return groups_.back().uid;
}

// -- the issue path ------------------------------------------------------------------------------

std::vector<FrameRef>& Core::capture() {
  if (fail_record_ > 0 && fail_record_-- > 0) throw std::runtime_error("a recorder bug (injected)");
  thread_local std::vector<FrameRef> frames;
  stacks_.capture(frames);
  if (stacks_.newly_full()) {
    bug("keeping a stack", ("the code table is full (" + std::to_string(CodeTable::kMax) +
                            " code objects): stacks end at code first met after it filled")
                               .c_str());
  }
  return frames;
}

// The new record's slot, filled but for its tensors (under the mutex).
Rec& Core::open(int32_t gid, Op op, const std::string& backend, int peer, Works& dead) {
  Group& grp = groups_[gid];
  grp.op_id += 1;
  // Inside a coalescing block only its first operation advances a counter: torch numbers
  // the block's operations, and the "coalesced" entry that ends it, alike.
  bool advance = !grp.coalescing || grp.coalesced.empty();
  bool p2p = op == SEND || op == RECV || op == RECV_ANYSOURCE;
  if (p2p) grp.p2p_seq += advance; else grp.seq += advance;
  int64_t rid = next_id_++;
  Rec& r = slot(rid, dead);
  r.record_id = rid; r.group = gid; r.op = op; r.state = SCHEDULED;
  r.is_p2p = p2p; r.me = grp.rank; r.peer = peer;
  r.seq = grp.seq; r.p2p_seq = grp.p2p_seq; r.op_id = grp.op_id;
  r.thread_id = static_cast<uint64_t>(pthread_self());
  r.created = now_ns(); r.started = 0; r.completed = 0;
  r.in.clear(); r.out.clear(); r.has_out = false; r.error.clear();
  r.backend = backend;
  return r;
}

// The record, its tensors filled in, takes its stack and goes to the ring file (under the mutex).
int64_t Core::close(Rec& r, const std::vector<FrameRef>& frames) {
  r.frames.assign(frames.begin(), frames.end());  // into the slot's kept capacity
  Group& grp = groups_[r.group];
  if (grp.coalescing) grp.coalesced.push_back(r.record_id);
  if (file_.open()) file_.full(r, name_of(r));
  return r.record_id;
}

void Core::start_coalescing(int32_t gid) {
  std::lock_guard<std::mutex> g(mu_);
  groups_[gid].coalescing = true;
  groups_[gid].coalesced.clear();
}

int64_t Core::end_coalescing(int32_t gid) {
  Works dead;  // dropped after unlocking
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

c10::intrusive_ptr<c10d::Work> Core::issued(int64_t rid, c10::intrusive_ptr<c10d::Work> work) {
  if (rid < 0 || !work) return work;
  try {
    return issued_(rid, work);
  } catch (const std::exception& e) {
    bug("tracking an operation's completion", e.what());
    return work;
  }
}

c10::intrusive_ptr<c10d::Work> Core::issued_(int64_t rid, c10::intrusive_ptr<c10d::Work> work) {
  if (fail_track_ > 0 && fail_track_-- > 0) throw std::runtime_error("a recorder bug (injected)");
  Works done;  // dropped after unlocking
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

void Core::started(int64_t rid) {
  std::lock_guard<std::mutex> g(mu_);
  Rec* r = find(rid);
  if (r == nullptr) return;
  r->started = now_ns();
  r->state = STARTED;
  file_.progress(*r);
  if (!r->is_p2p) groups_[r->group].last_started = r->seq;
}

void Core::finish(int64_t rid) {
  Works done;
  std::lock_guard<std::mutex> g(mu_);
  Rec* r = find(rid);
  if (r != nullptr && r->state != COMPLETED) complete(*r, now_ns(), done);
}

void Core::refused(int64_t rid, const char* error) {
  std::lock_guard<std::mutex> g(mu_);
  if (Rec* r = find(rid)) r->error = std::string(error).substr(0, 300);
}

// -- what Python asks ----------------------------------------------------------------------------

void Core::reap(int64_t min_age_ns) {
  Works done;
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

std::vector<int64_t> Core::inflight() {
  Works done;
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

int64_t Core::oldest_inflight() {
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

std::vector<int64_t> Core::suspect(int32_t gid) {
  std::lock_guard<std::mutex> g(mu_);
  std::vector<int64_t> out;
  for (auto& r : ring_) {
    if (r.in_use && r.group == gid) { r.pinned = true; out.push_back(r.record_id); }
  }
  return out;
}

py::list Core::snapshot(const std::vector<int64_t>& only) {
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

// The new communicator's sequence numbers start again, as torch restarts its own. Operations
// still in flight stay queued: they belong to the communicator before.
void Core::regroup(int32_t gid, int32_t rank) {
  std::lock_guard<std::mutex> g(mu_);
  Group& grp = groups_[gid];
  grp.rank = rank;
  grp.seq = grp.op_id = grp.last_started = grp.last_completed = 0;
  grp.p2p_seq = p2p_seq_base_;
}

py::tuple Core::group_status(int32_t gid) {
  std::lock_guard<std::mutex> g(mu_);
  Group& grp = groups_[gid];
  return py::make_tuple(grp.seq, grp.last_started, grp.last_completed, grp.p2p_seq, grp.op_id);
}

py::tuple Core::last_done(int32_t gid) {
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

void Core::forget_last_done(int32_t gid, int64_t rid) {
  c10::intrusive_ptr<c10d::Work> drop;
  std::lock_guard<std::mutex> g(mu_);
  Group& grp = groups_[gid];
  if (grp.last_done == rid) { grp.last_done = -1; drop = std::move(grp.last_done_work); }
}

void Core::mark_failed(int64_t rid, const std::string& error) {
  std::lock_guard<std::mutex> g(mu_);
  if (Rec* r = find(rid)) {
    r->error = error; r->state = STARTED; r->completed = 0;
    file_.progress(*r);
  }
}

py::list Core::bugs() {
  std::vector<std::string> taken;
  {
    std::lock_guard<std::mutex> g(mu_);
    taken.swap(bugs_);
  }
  py::list out;
  for (auto& b : taken) out.append(b);
  return out;
}

void Core::fail_next(const std::string& what, int n) {
  (what == "record" ? fail_record_ : fail_track_) = n;
}

// -- the ring in memory (the caller holds the mutex) ---------------------------------------------

// The ring slot for a new record id; an evicted entry is kept aside if pinned.
// `dead` takes the works released meanwhile, to drop after unlocking.
Rec& Core::slot(int64_t rid, Works& dead) {
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

const Rec* Core::find(int64_t rid) const {
  if (rid < 0) return nullptr;
  const Rec& r = ring_[static_cast<size_t>(rid) % ring_.size()];
  if (r.in_use && r.record_id == rid) return &r;
  auto it = kept_.find(rid);
  if (it != kept_.end()) return &it->second;
  auto at = aside_.find(rid);
  return at == aside_.end() ? nullptr : &at->second;
}

// A completed operation that had left the ring is forgotten.
void Core::retire(int64_t rid) {
  auto at = aside_.find(rid);
  if (at == aside_.end() || at->second.state != COMPLETED) return;
  if (at->second.work) graveyard_.push_back(std::move(at->second.work));
  aside_.erase(at);
}

bool Core::poll(Rec& r, int64_t now, Works& done) {
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
void Core::complete(Rec& r, int64_t now, Works& done, bool failed) {
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

void Core::drain(Group& grp, int64_t now, int64_t min_age, Works& done) {
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

// Told to Python (which logs each kind once) when it next asks: no logging from here.
void Core::bug(const char* what, const char* why) {
  std::lock_guard<std::mutex> g(mu_);
  if (bugs_.size() < 16) bugs_.push_back(std::string(what) + ": " + why);
}

}  // namespace tether
