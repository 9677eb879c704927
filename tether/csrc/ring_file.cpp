// The core's writer of ring-file records (ring_file.h), at the offsets declared there.

#include "ring_file.h"

#include <fcntl.h>
#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstring>
#include <utility>

namespace tether {

using namespace layout;

namespace {

template <typename T>
void put(uint8_t* p, const Field& f, T v, size_t at = 0) {
  std::memcpy(p + f.offset + at, &v, sizeof v);
}

// One side's shapes (which: 0 inputs, 1 outputs): the first kTensors, each with its true rank
// and its first kDims dimensions.
void side(uint8_t* p, size_t which, const Shapes& sh) {
  size_t at = 0;
  for (size_t i = 0; i < sh.ndims.size(); ++i) {
    size_t n = sh.ndims[i];
    if (i < kTensors) {
      size_t k = which * kTensors + i;
      p[kNdims.offset + k] = static_cast<uint8_t>(n);
      for (size_t d = 0; d < std::min(n, kDims); ++d) {
        put<int64_t>(p, kShapeDims, sh.dims[at + d], (k * kDims + d) * 8);
      }
      const char* dt = c10::toString(static_cast<c10::ScalarType>(sh.dtypes[i]));
      std::memcpy(p + kDtypes.offset + k * kDtypeBytes, dt, std::min(std::strlen(dt), kDtypeBytes - 1));
    }
    at += n;
  }
}

}  // namespace

RingFile::RingFile(const std::string& path, size_t records_at, size_t capacity)
    : records_at_(records_at), capacity_(capacity) {
  if (path.empty()) return;
  int fd = ::open(path.c_str(), O_RDWR | O_CLOEXEC);
  if (fd < 0) return;
  size_ = records_at + capacity * kRecordSize;
  void* p = ::mmap(nullptr, size_, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
  ::close(fd);
  if (p != MAP_FAILED) base_ = static_cast<uint8_t*>(p);
}

RingFile::~RingFile() {
  if (base_ != nullptr) ::munmap(base_, size_);
}

RingFile& RingFile::operator=(RingFile&& o) noexcept {
  std::swap(base_, o.base_);
  std::swap(size_, o.size_);
  records_at_ = o.records_at_;
  capacity_ = o.capacity_;
  return *this;
}

void RingFile::full(const Rec& r, const std::string& name) {
  uint8_t* p = begin_write(r.record_id);
  if (p == nullptr) return;
  p[kState.offset] = r.state;
  p[kIsP2p.offset] = r.is_p2p;
  p[kInputs.offset] = static_cast<uint8_t>(std::min<size_t>(r.in.ndims.size(), 254));
  p[kOutputs.offset] =
      r.has_out ? static_cast<uint8_t>(std::min<size_t>(r.out.ndims.size(), 254)) : kSameAsInputs;
  put<int64_t>(p, kRecordId, r.record_id);
  put<int32_t>(p, kGroup, r.group);
  put<int64_t>(p, kSeq, r.seq);
  put<int64_t>(p, kP2pSeq, r.p2p_seq);
  put<int64_t>(p, kOpId, r.op_id);
  put<uint64_t>(p, kThreadId, r.thread_id);
  put<int64_t>(p, kCreated, r.created);
  put<int64_t>(p, kStarted, r.started);
  put<int64_t>(p, kCompleted, r.completed);
  std::memset(p + kProfilingName.offset, 0, kNameBytes);
  std::memcpy(p + kProfilingName.offset, name.data(), std::min(name.size(), kNameBytes - 1));
  std::memset(p + kNdims.offset, 0, kDtypes.offset + kDtypes.size - kNdims.offset);
  side(p, 0, r.in);
  if (r.has_out) side(p, 1, r.out);
  end_write(p);
}

void RingFile::progress(const Rec& r) {
  uint8_t* p = begin_write(r.record_id);
  if (p == nullptr) return;
  p[kState.offset] = r.state;
  put<int64_t>(p, kStarted, r.started);
  put<int64_t>(p, kCompleted, r.completed);
  end_write(p);
}

// The sequence word is odd while the record is written: a death mid-write leaves it odd, and
// the reader passes the record over. Signal fences keep the compiler from moving the stores
// across it (a death, not another thread, is the reader to guard against).
uint8_t* RingFile::begin_write(int64_t rid) {
  if (base_ == nullptr || capacity_ == 0) return nullptr;
  uint8_t* p = base_ + records_at_ + (static_cast<size_t>(rid) % capacity_) * kRecordSize;
  uint32_t seq;
  std::memcpy(&seq, p + kSeqWord.offset, 4);
  seq |= 1;
  std::memcpy(p + kSeqWord.offset, &seq, 4);
  std::atomic_signal_fence(std::memory_order_seq_cst);
  return p;
}

void RingFile::end_write(uint8_t* p) {
  std::atomic_signal_fence(std::memory_order_seq_cst);
  uint32_t seq;
  std::memcpy(&seq, p + kSeqWord.offset, 4);
  seq += 1;
  std::memcpy(p + kSeqWord.offset, &seq, 4);
}

}  // namespace tether
