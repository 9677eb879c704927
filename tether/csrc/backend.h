// The recorded backend: RecordingBackend, a c10d::Backend over each device's real backend of a
// plain torch ProcessGroup (no Python subclass, so no pybind trampoline and no GIL on the hot
// path), and WaitReportingWork, the work handed back where completion shows only in wait().
#pragma once

#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#if __has_include(<torch/headeronly/version.h>)
#include <torch/headeronly/version.h>
#else
#include <torch/version.h>
#endif

#include <atomic>
#include <memory>
#include <string>
#include <tuple>
#include <unordered_map>
#include <vector>

#include "core.h"

// A torch release at least MAJOR.MINOR (feature macros cover what torch names; 2.15's additions
// to c10d::Backend have none).
#define TETHER_TORCH_AT_LEAST(MAJOR, MINOR) \
  (TORCH_VERSION_MAJOR > (MAJOR) || (TORCH_VERSION_MAJOR == (MAJOR) && TORCH_VERSION_MINOR >= (MINOR)))

namespace tether {

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

// (device, its real backend, the backend's name in dumps), as RecordingBackend takes them.
using Inners =
    std::vector<std::tuple<std::string, c10::intrusive_ptr<c10d::Backend>, std::string>>;

// The recording backend: one per process group, over each device's real backend. What it does
// not record it forwards to the backend it wraps (backend.cpp says why for each kind).
class RecordingBackend : public c10d::Backend {
 public:
  RecordingBackend(std::shared_ptr<Core> core, int32_t gid, int rank, int size, Inners inners,
                   const std::string& default_device);

  // -- for Python (native.py) -------------------------------------------------------------------
  c10::intrusive_ptr<c10d::Backend> inner(const std::string& device) const;
  void set_ready(bool ready) { ready_.store(ready, std::memory_order_relaxed); }
  bool attached() const { return gid_ != kUnattached; }
  void attach(int32_t gid);
  void replace(const c10::intrusive_ptr<c10d::Backend>& backend, int rank, int size);

  // -- recorded operations ----------------------------------------------------------------------
  using WorkPtr = c10::intrusive_ptr<c10d::Work>;
  using Tensors = std::vector<at::Tensor>;
  using TensorLists = std::vector<std::vector<at::Tensor>>;
  WorkPtr broadcast(Tensors& t, const c10d::BroadcastOptions& o) override;
  WorkPtr allreduce(Tensors& t, const c10d::AllreduceOptions& o) override;
  WorkPtr allreduce_sparse(Tensors& t, const c10d::AllreduceOptions& o) override;
  WorkPtr allreduce_coalesced(Tensors& t, const c10d::AllreduceCoalescedOptions& o) override;
  WorkPtr reduce(Tensors& t, const c10d::ReduceOptions& o) override;
  WorkPtr allgather(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override;
  WorkPtr _allgather_base(at::Tensor& out, at::Tensor& in, const c10d::AllgatherOptions& o) override;
  WorkPtr allgather_coalesced(TensorLists& out, Tensors& in, const c10d::AllgatherOptions& o) override;
  WorkPtr allgather_into_tensor_coalesced(Tensors& out, Tensors& in,
                                       const c10d::AllgatherOptions& o) override;
  WorkPtr gather(TensorLists& out, Tensors& in, const c10d::GatherOptions& o) override;
  WorkPtr scatter(Tensors& out, TensorLists& in, const c10d::ScatterOptions& o) override;
  WorkPtr reduce_scatter(Tensors& out, TensorLists& in, const c10d::ReduceScatterOptions& o) override;
  WorkPtr _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                            const c10d::ReduceScatterOptions& o) override;
  WorkPtr reduce_scatter_tensor_coalesced(Tensors& out, Tensors& in,
                                       const c10d::ReduceScatterOptions& o) override;
  WorkPtr alltoall_base(at::Tensor& out, at::Tensor& in, std::vector<int64_t>& os,
                     std::vector<int64_t>& is, const c10d::AllToAllOptions& o) override;
  WorkPtr alltoall(Tensors& out, Tensors& in, const c10d::AllToAllOptions& o) override;
  WorkPtr barrier(const c10d::BarrierOptions& o) override;
  WorkPtr send(Tensors& t, int dst, int tag) override;
  WorkPtr recv(Tensors& t, int src, int tag) override;
  WorkPtr recvAnysource(Tensors& t, int tag) override;
  void monitoredBarrier(const c10d::BarrierOptions& o, bool wait_all) override;
  void startCoalescing() override;
  WorkPtr endCoalescing() override;

  // -- forwarded to the wrapped backend ---------------------------------------------------------
  const std::string getBackendName() const override;
  bool supportsSplitting() const override;
  bool supportsCoalescing() const override;
  void setTimeout(std::chrono::milliseconds t) override;
  c10::intrusive_ptr<Options> getBackendOptions() override;
  void setGroupUid(const std::string& uid) override;
  void eagerConnectSingleDevice(at::Device d) override;
  c10d::ErrorType getError() override;
  void abort() override;
  void shutdown() override;
  void setSequenceNumberForGroup() override;
  uint64_t getSequenceNumberForGroup() override;
  void registerOnCompletionHook(
      std::function<void(std::shared_ptr<c10d::WorkInfo>)>&& hook) override;
  void waitForPendingWorks() override;
  void enableCollectivesTiming() override;
  c10::intrusive_ptr<c10d::Backend> split(const c10::intrusive_ptr<c10d::Store>& store,
                                          const std::vector<int>& ranks,
                                          const c10::intrusive_ptr<Options>& opts) override;
  c10::intrusive_ptr<c10d::Backend> merge(const c10::intrusive_ptr<c10d::Store>& store,
                                          const c10::intrusive_ptr<Options>& opts,
                                          const int& rank, const int& size) override;
  bool supportsShrinking() const override;
  c10::intrusive_ptr<c10d::Backend> shrink(const std::vector<int64_t>& ranks_to_exclude,
                                           int shrink_flags,
                                           const c10::intrusive_ptr<Options>& opts) override;
  bool supportsTimeEstimation() const override;
  std::shared_ptr<c10::Allocator> getMemAllocator() override;
  at::Tensor allocateTensor(long size, at::TensorOptions options) override;
  bool supportsTensorAlloc(c10::DeviceIndex index) override;
  void suspend() override;
  void resume() override;
  std::unordered_map<std::string, uint64_t> getMemoryStats() override;
#ifdef C10D_BACKEND_HAS_RECONFIGURE  // torch 2.14+
  bool supportsReconfigure() const override;
  c10d::ReconfigureHandle get_reconfigure_handle() const override;
  WorkPtr reconfigure(const c10d::ReconfigureOptions& o) override;
#endif
#if TETHER_TORCH_AT_LEAST(2, 14)
  void addEphemeralTimeout(const std::chrono::milliseconds& t) override;
  void registerAbortHook(int64_t id, c10d::AbortHook hook) override;
  void unregisterAbortHook(int64_t id) override;
  WorkPtr gather_single(at::Tensor& out, at::Tensor& in, const c10d::GatherOptions& o) override;
#endif
#ifdef C10D_BACKEND_HAS_WINDOW  // torch 2.14+
  bool supportsWindow() const override;
  c10::intrusive_ptr<c10d::Window> new_window(const std::optional<at::Tensor>& t) override;
#endif
#if TETHER_TORCH_AT_LEAST(2, 15)
  bool isInitialized() override;
  void startTimeEstimate() override;
  float endTimeEstimate() override;
  bool supportsAbortHooks() const override;
  bool supportsCompletionHooks() const override;
  void registerCompletionHook(int64_t id, c10d::CompletionHook hook) override;
  void unregisterCompletionHook(int64_t id) override;
#endif

 private:
  struct Inner {
    c10::DeviceType type;
    c10::intrusive_ptr<c10d::Backend> b;
    std::string name;
    Inner(c10::DeviceType t, c10::intrusive_ptr<c10d::Backend> be, std::string n)
        : type(t), b(std::move(be)), name(std::move(n)) {}
  };
  const Inner& by_options(const c10::intrusive_ptr<Options>& opts) const;
  c10::intrusive_ptr<c10d::Backend> derived(const Inner& parent,
                                            const c10::intrusive_ptr<c10d::Backend>& child);
  c10::DeviceType default_type() const;
  const Inner& pick(c10::DeviceType type) const;
  void check_ready() const;

  static constexpr int32_t kUnattached = -1;
  std::shared_ptr<Core> core_;
  int32_t gid_;  // kUnattached until attach(): set before the group is handed to its user
  std::vector<Inner> inners_;
  c10::intrusive_ptr<c10d::Backend> default_;
  std::atomic<bool> ready_{true};
};

}  // namespace tether
