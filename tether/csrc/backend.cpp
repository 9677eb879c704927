// The recorded backend (backend.h): records each operation in the core around the real call.

#include "backend.h"

namespace tether {

using RB = RecordingBackend;
using WorkPtr = RB::WorkPtr;
using Tensors = RB::Tensors;
using TensorLists = RB::TensorLists;
using BackendPtr = c10::intrusive_ptr<c10d::Backend>;

namespace {

c10::DeviceType dev(const Tensors& t) {
  return t.empty() ? c10::DeviceType::CPU : t[0].device().type();
}

}  // namespace

bool WaitReportingWork::wait(std::chrono::milliseconds timeout) {
  bool ok = inner_->wait(timeout);
  if (!waited_.exchange(true)) core_->finish(rid_);
  return ok;
}

RB::RecordingBackend(std::shared_ptr<Core> core, int32_t gid, int rank, int size, Inners inners,
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

BackendPtr RB::inner(const std::string& device) const {
  if (device.empty()) return default_;
  auto type = c10::Device(device).type();
  for (auto& [t, b, n] : inners_) if (t == type) return b;
  return default_;
}

// torch 2.13 has no reconfigure; tether's (tether/recorder/reconfigure.py) keeps a group
// created with enable_reconfigure unready until its first reconfigure, as torch 2.14's gloo
// does, then puts each new communicator's backend in place of the one wrapped here. The
// caller issues nothing on the group meanwhile (torch's contract for reconfigure too).
void RB::attach(int32_t gid) {
  TORCH_CHECK(!attached(), "this recording backend already records group ", gid_);
  gid_ = gid;
}

void RB::replace(const BackendPtr& backend, int rank, int size) {
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

// -- recorded operations --------------------------------------------------------------------------

// A `try` costs nothing until something raises. The attached() test is one predictable branch
// on a member this call reads anyway (gid_); it lets a split's child pass operations through
// until its group is known, instead of a second backend class for that one moment.
#define TETHER_RECORD(OP, DEVICE, PEER, FILL, CALL)                                         \
  auto& chosen = pick(DEVICE);                                                             \
  if (!attached()) return chosen.b->CALL;                                                  \
  int64_t rid = core_->begin(gid_, OP, chosen.name, PEER, [&](Rec& r) { FILL; });          \
  WorkPtr work;                                                                            \
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

#define TETHER_BOTH (r.in.add(in), r.out.add(out), r.has_out = true)

WorkPtr RB::broadcast(Tensors& t, const c10d::BroadcastOptions& o) {
  TETHER_RECORD(BROADCAST, dev(t), -1, r.in.add(t), broadcast(t, o))
}
WorkPtr RB::allreduce(Tensors& t, const c10d::AllreduceOptions& o) {
  TETHER_RECORD(ALLREDUCE, dev(t), -1, r.in.add(t), allreduce(t, o))
}
WorkPtr RB::allreduce_sparse(Tensors& t, const c10d::AllreduceOptions& o) {
  return pick(dev(t)).b->allreduce_sparse(t, o);  // unrecorded, as on the Python path
}
WorkPtr RB::allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) {
  TETHER_RECORD(ALLREDUCE_COALESCED, dev(t), -1, r.in.add(t), allreduce_coalesced(t, o))
}
WorkPtr RB::reduce(Tensors& t, const c10d::ReduceOptions& o) {
  TETHER_RECORD(REDUCE, dev(t), -1, r.in.add(t), reduce(t, o))
}
WorkPtr RB::allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) {
  TETHER_RECORD(ALLGATHER, dev(in), -1, TETHER_BOTH, allgather(out, in, o))
}
WorkPtr RB::_allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) {
  TETHER_RECORD(ALLGATHER_BASE, in.device().type(), -1, TETHER_BOTH, _allgather_base(out, in, o))
}
WorkPtr RB::allgather_coalesced(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) {
  TETHER_RECORD(ALLGATHER_COALESCED, dev(in), -1, TETHER_BOTH, allgather_coalesced(out, in, o))
}
WorkPtr RB::allgather_into_tensor_coalesced(Tensors& out, Tensors& in,
                                            const c10d::AllgatherOptions& o) {
  TETHER_RECORD(ALLGATHER_INTO_TENSOR_COALESCED, dev(in), -1, TETHER_BOTH,
                allgather_into_tensor_coalesced(out, in, o))
}
WorkPtr RB::gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) {
  TETHER_RECORD(GATHER, dev(in), -1, TETHER_BOTH, gather(out, in, o))
}
WorkPtr RB::scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) {
  TETHER_RECORD(SCATTER, dev(out), -1, TETHER_BOTH, scatter(out, in, o))
}
WorkPtr RB::reduce_scatter(Tensors& out, TensorLists& in, const c10d::ReduceScatterOptions& o) {
  TETHER_RECORD(REDUCE_SCATTER, dev(out), -1, TETHER_BOTH, reduce_scatter(out, in, o))
}
WorkPtr RB::_reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                 const c10d::ReduceScatterOptions& o) {
  TETHER_RECORD(REDUCE_SCATTER_BASE, in.device().type(), -1, TETHER_BOTH,
                _reduce_scatter_base(out, in, o))
}
WorkPtr RB::reduce_scatter_tensor_coalesced(Tensors& out, Tensors& in,
                                            const c10d::ReduceScatterOptions& o) {
  TETHER_RECORD(REDUCE_SCATTER_TENSOR_COALESCED, dev(in), -1, TETHER_BOTH,
                reduce_scatter_tensor_coalesced(out, in, o))
}
WorkPtr RB::alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                          std::vector<int64_t>& is, const c10d::AllToAllOptions& o) {
  TETHER_RECORD(ALLTOALL_BASE, in.device().type(), -1, TETHER_BOTH,
                alltoall_base(out, in, os, is, o))
}
WorkPtr RB::alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) {
  TETHER_RECORD(ALLTOALL, dev(in), -1, TETHER_BOTH, alltoall(out, in, o))
}
WorkPtr RB::barrier(const c10d::BarrierOptions& o) {
  auto device = o.device.has_value() ? o.device->type() : default_type();
  TETHER_RECORD(BARRIER, device, -1, (void)r, barrier(o))
}
WorkPtr RB::send(Tensors& t, int dst, int tag) {
  TETHER_RECORD(SEND, dev(t), dst, r.in.add(t), send(t, dst, tag))
}
WorkPtr RB::recv(Tensors& t, int src, int tag) {
  TETHER_RECORD(RECV, dev(t), src, r.in.add(t), recv(t, src, tag))
}
WorkPtr RB::recvAnysource(Tensors& t, int tag) {
  TETHER_RECORD(RECV_ANYSOURCE, dev(t), -1, r.in.add(t), recvAnysource(t, tag))
}
#undef TETHER_BOTH
#undef TETHER_RECORD

void RB::monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) {
  auto& chosen = pick(c10::DeviceType::CPU);  // torch dispatches it to the CPU backend (gloo)
  if (!attached()) return chosen.b->monitoredBarrier(o, wait_all);
  int64_t rid = core_->begin(gid_, MONITORED_BARRIER, chosen.name, -1, [](Rec&) {});
  check_ready();
  core_->started(rid);
  chosen.b->monitoredBarrier(o, wait_all);
  core_->finish(rid);
}

void RB::startCoalescing() {
  if (attached()) core_->start_coalescing(gid_);
  default_->startCoalescing();
}

WorkPtr RB::endCoalescing() {
  if (!attached()) return default_->endCoalescing();
  int64_t rid = core_->end_coalescing(gid_);
  return core_->issued(rid, default_->endCoalescing());
}

// -- forwarded -----------------------------------------------------------------------------------
// What else torch calls on a group's backend, answered by the backend wrapped here: a method
// left to c10d::Backend's default would refuse ("Backend ... is missing implementation of
// split") where the group's own backend does it.

const std::string RB::getBackendName() const { return default_->getBackendName(); }
bool RB::supportsSplitting() const { return default_->supportsSplitting(); }
bool RB::supportsCoalescing() const { return default_->supportsCoalescing(); }
void RB::setTimeout(std::chrono::milliseconds t) { for (auto& i : inners_) i.b->setTimeout(t); }
c10::intrusive_ptr<c10d::Backend::Options> RB::getBackendOptions() {
  return default_->getBackendOptions();
}
void RB::setGroupUid(const std::string& uid) {
  c10d::Backend::setGroupUid(uid);
  for (auto& i : inners_) i.b->setGroupUid(uid);
}
void RB::eagerConnectSingleDevice(at::Device d) { pick(d.type()).b->eagerConnectSingleDevice(d); }
c10d::ErrorType RB::getError() { return default_->getError(); }
void RB::abort() { for (auto& i : inners_) i.b->abort(); }
void RB::shutdown() { for (auto& i : inners_) i.b->shutdown(); }
void RB::setSequenceNumberForGroup() { default_->setSequenceNumberForGroup(); }
uint64_t RB::getSequenceNumberForGroup() { return default_->getSequenceNumberForGroup(); }
void RB::registerOnCompletionHook(std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) {
  default_->registerOnCompletionHook(std::move(hook));
}
void RB::waitForPendingWorks() { default_->waitForPendingWorks(); }
void RB::enableCollectivesTiming() { for (auto& i : inners_) i.b->enableCollectivesTiming(); }

// A group split or merged from a recorded one gets the wrapped backend's child;
// tether/recorder/patch.py records the new group as it records any other. torch registers a
// split's or a merge's child in the new group under the parent's backend type for the device
// (ours, CUSTOM), so the child must be a recording backend too: it passes operations through
// unrecorded until tether/recorder/native.py attaches it to its group. A shrink's child goes to
// a group torch builds afresh, which tether wraps like any other.
BackendPtr RB::split(const c10::intrusive_ptr<c10d::Store>& store, const std::vector<int>& ranks,
                     const c10::intrusive_ptr<Options>& opts) {
  auto& inner = by_options(opts);
  return derived(inner, inner.b->split(store, ranks, opts));
}
BackendPtr RB::merge(const c10::intrusive_ptr<c10d::Store>& store,
                     const c10::intrusive_ptr<Options>& opts, const int& rank, const int& size) {
  auto& inner = by_options(opts);
  return derived(inner, inner.b->merge(store, opts, rank, size));
}
bool RB::supportsShrinking() const { return default_->supportsShrinking(); }
BackendPtr RB::shrink(const std::vector<int64_t>& ranks_to_exclude, int shrink_flags,
                      const c10::intrusive_ptr<Options>& opts) {
  return by_options(opts).b->shrink(ranks_to_exclude, shrink_flags, opts);
}
bool RB::supportsTimeEstimation() const { return default_->supportsTimeEstimation(); }
std::shared_ptr<c10::Allocator> RB::getMemAllocator() { return default_->getMemAllocator(); }
at::Tensor RB::allocateTensor(long size, at::TensorOptions options) {
  return default_->allocateTensor(size, options);
}
bool RB::supportsTensorAlloc(c10::DeviceIndex index) {
  return default_->supportsTensorAlloc(index);
}
void RB::suspend() { for (auto& i : inners_) i.b->suspend(); }
void RB::resume() { for (auto& i : inners_) i.b->resume(); }
std::unordered_map<std::string, uint64_t> RB::getMemoryStats() {
  return default_->getMemoryStats();
}
#ifdef C10D_BACKEND_HAS_RECONFIGURE  // torch 2.14+
bool RB::supportsReconfigure() const { return default_->supportsReconfigure(); }
c10d::ReconfigureHandle RB::get_reconfigure_handle() const {
  return default_->get_reconfigure_handle();
}
// The wrapped backend's own reconfigure; then this group is what it became (torch reads a
// group's rank and size from its backend after a reconfigure).
WorkPtr RB::reconfigure(const c10d::ReconfigureOptions& o) {
  auto work = default_->reconfigure(o);
  rank_ = default_->getRank();
  size_ = default_->getSize();
  if (attached()) core_->regroup(gid_, rank_);
  return work;
}
#endif
#if TETHER_TORCH_AT_LEAST(2, 14)
void RB::addEphemeralTimeout(const std::chrono::milliseconds& t) {
  for (auto& i : inners_) i.b->addEphemeralTimeout(t);
}
void RB::registerAbortHook(int64_t id, c10d::AbortHook hook) {
  default_->registerAbortHook(id, std::move(hook));
}
void RB::unregisterAbortHook(int64_t id) { default_->unregisterAbortHook(id); }
WorkPtr RB::gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) {
  return pick(in.device().type()).b->gather_single(out, in, o);  // unrecorded, as allreduce_sparse
}
#endif
#ifdef C10D_BACKEND_HAS_WINDOW  // torch 2.14+
bool RB::supportsWindow() const { return default_->supportsWindow(); }
c10::intrusive_ptr<c10d::Window> RB::new_window(const std::optional<at::Tensor>& t) {
  return default_->new_window(t);
}
#endif
#if TETHER_TORCH_AT_LEAST(2, 15)
bool RB::isInitialized() { return default_->isInitialized(); }
void RB::startTimeEstimate() { default_->startTimeEstimate(); }
float RB::endTimeEstimate() { return default_->endTimeEstimate(); }
bool RB::supportsAbortHooks() const { return default_->supportsAbortHooks(); }
bool RB::supportsCompletionHooks() const { return default_->supportsCompletionHooks(); }
void RB::registerCompletionHook(int64_t id, c10d::CompletionHook hook) {
  default_->registerCompletionHook(id, std::move(hook));
}
void RB::unregisterCompletionHook(int64_t id) { default_->unregisterCompletionHook(id); }
#endif

// -- which wrapped backend ----------------------------------------------------------------------

// The wrapped backend an options object belongs to (a group of several backends splits each
// with its own options); the default one when no name matches.
const RB::Inner& RB::by_options(const c10::intrusive_ptr<Options>& opts) const {
  if (opts) {
    for (auto& i : inners_) if (i.b->getBackendName() == opts->backend) return i;
  }
  for (auto& i : inners_) if (i.b.get() == default_.get()) return i;
  return inners_[0];
}

BackendPtr RB::derived(const Inner& parent, const BackendPtr& child) {
  if (!child) return child;  // this rank is in none of the split's groups
  Inners inners;
  std::string device = c10::DeviceTypeName(parent.type, /*lower_case=*/true);
  inners.emplace_back(device, child, parent.name);
  return c10::make_intrusive<RecordingBackend>(core_, kUnattached, child->getRank(),
                                               child->getSize(), inners, device);
}

c10::DeviceType RB::default_type() const {
  for (auto& i : inners_) if (i.b.get() == default_.get()) return i.type;
  return c10::DeviceType::CPU;
}

const RB::Inner& RB::pick(c10::DeviceType type) const {
  if (inners_.size() == 1) return inners_[0];
  for (auto& i : inners_) if (i.type == type) return i;
  for (auto& i : inners_) if (i.b.get() == default_.get()) return i;
  return inners_[0];
}

void RB::check_ready() const {
  TORCH_CHECK(ready_.load(std::memory_order_relaxed),
              "ProcessGroupGloo has not been initialized. Call reconfigure() before issuing "
              "collectives when enable_reconfigure=True.");
}

}  // namespace tether
