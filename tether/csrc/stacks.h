// Stacks: the issuing thread's Python frames, captured without the GIL.
//
// The issuing thread walks its own interpreter frames (which hold still while it is in here, in
// C++) and keeps (code, offset) pairs whose code objects the CodeTable holds; the GIL is taken
// only the first time a code object is seen. Only stacks.cpp reads the interpreter's internal
// frame layout.
#pragma once

#include <Python.h>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <cstdint>
#include <memory>
#include <vector>

struct _PyInterpreterFrame;  // CPython's, defined in stacks.cpp's internal header

namespace tether {

namespace py = pybind11;

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
  bool add(PyCodeObject* code, bool library);  // with the GIL; false when full (not held)

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

// Captures stacks as recorder/frames.py's capture keeps them: `depth` frames and, past them,
// when the outermost kept is a library's, the first frame that is not (after an elision marker),
// looking at most `walk_on` frames further. is_library(filename) -> bool says which is which.
class Stacks {
 public:
  Stacks(int depth, int walk_on, py::object is_library)
      : depth_(depth), walk_on_(walk_on), is_library_(std::move(is_library)) {}
  // At interpreter exit Python may be gone already: leak the callable (and the code table's
  // references) rather than crash.
  ~Stacks() { is_library_.release(); }
  Stacks(const Stacks&) = delete;
  Stacks& operator=(const Stacks&) = delete;

  // The calling thread's stack, innermost first (cleared: no Python stack, or capture off).
  void capture(std::vector<FrameRef>& out);
  void set_depth(int depth) { depth_ = depth; }
  // True once, the first time it is asked after the code table filled (the core tells Python).
  bool newly_full() {
    return full_.load(std::memory_order_relaxed) && !full_told_.exchange(true);
  }

 private:
  bool walk(_PyInterpreterFrame* f, std::vector<FrameRef>& out, bool gil);
  int8_t meet(PyCodeObject* code);

  int depth_;
  int walk_on_;
  py::object is_library_;
  CodeTable codes_;
  std::atomic<bool> full_{false}, full_told_{false};
};

}  // namespace tether
