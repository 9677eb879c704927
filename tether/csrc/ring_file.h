// The ring file's record: its layout, declared here once, and the core's writer of it.
//
// tether/events/ringfile.py documents the whole file and reads it (the Python recorder writes the
// same records). The bindings export this layout (RECORD_LAYOUT) and tether/recorder/native.py
// refuses a core whose layout is not ringfile.py's, so the two cannot drift apart unnoticed.
#pragma once

#include <cstddef>
#include <cstdint>
#include <string>

#include "record.h"

namespace tether {

namespace layout {

struct Field {
  const char* name;
  size_t offset, size;
};

constexpr uint32_t kVersion = 1;  // ringfile.VERSION: bumped with any change below
constexpr size_t kRecordSize = 512;
constexpr size_t kTensors = 4;  // shapes kept per side of an operation
constexpr size_t kDims = 4;     // dimensions kept per shape
constexpr size_t kDtypeBytes = 12;   // bytes of a dtype's name (NUL-terminated)
constexpr size_t kNameBytes = 48;    // bytes of the profiling name (NUL-terminated)
constexpr uint8_t kSameAsInputs = 255;  // the outputs count: the outputs are the inputs

// Little-endian, in record order. The sequence word is odd while the record is written.
constexpr Field kSeqWord{"seq_word", 0, 4};
constexpr Field kState{"state", 4, 1};
constexpr Field kIsP2p{"is_p2p", 5, 1};
constexpr Field kInputs{"inputs", 6, 1};
constexpr Field kOutputs{"outputs", 7, 1};
constexpr Field kRecordId{"record_id", 8, 8};
constexpr Field kGroup{"group", 16, 4};  // then 4 bytes of padding
constexpr Field kSeq{"seq", 24, 8};
constexpr Field kP2pSeq{"p2p_seq", 32, 8};
constexpr Field kOpId{"op_id", 40, 8};
constexpr Field kThreadId{"thread_id", 48, 8};
constexpr Field kCreated{"created", 56, 8};
constexpr Field kStarted{"started", 64, 8};
constexpr Field kCompleted{"completed", 72, 8};
constexpr Field kProfilingName{"name", 80, kNameBytes};
constexpr Field kNdims{"ndims", 128, 2 * kTensors};                 // uint8 each
constexpr Field kShapeDims{"dims", 136, 2 * kTensors * kDims * 8};  // int64 each
constexpr Field kDtypes{"dtypes", 392, 2 * kTensors * kDtypeBytes};

constexpr Field kFields[] = {
    kSeqWord, kState, kIsP2p,     kInputs,    kOutputs, kRecordId,      kGroup,
    kSeq,     kP2pSeq, kOpId,     kThreadId,  kCreated, kStarted,       kCompleted,
    kProfilingName,    kNdims,    kShapeDims, kDtypes};

constexpr bool fields_fit() {  // in order, apart, inside a record
  size_t end = 0;
  for (const Field& f : kFields) {
    if (f.offset < end) return false;
    end = f.offset + f.size;
  }
  return end <= kRecordSize;
}
static_assert(fields_fit(), "the ring record's fields overlap or overflow the record");

}  // namespace layout

// The ring file's records, mapped: each record is written here as it is issued and as it
// advances, so that a process killed by any signal leaves its record in the page cache. Python
// (ringfile.RingFile) creates the file and writes its header and groups; records start at
// records_at.
class RingFile {
 public:
  RingFile() = default;
  RingFile(const std::string& path, size_t records_at, size_t capacity);
  ~RingFile();
  RingFile(const RingFile&) = delete;
  RingFile& operator=(const RingFile&) = delete;
  RingFile& operator=(RingFile&& o) noexcept;
  bool open() const { return base_ != nullptr; }

  void full(const Rec& r, const std::string& name);  // the whole record
  void progress(const Rec& r);                       // state and times only

 private:
  uint8_t* begin_write(int64_t rid);
  static void end_write(uint8_t* p);

  uint8_t* base_ = nullptr;
  size_t size_ = 0, records_at_ = 0, capacity_ = 0;
};

}  // namespace tether
