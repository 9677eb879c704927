// Stacks without the GIL (stacks.h): the one unit that reads the interpreter's frame layout.

#include <Python.h>
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

#include "stacks.h"

namespace tether {

namespace {

bool finalizing() {
#if PY_VERSION_HEX >= 0x030D0000
  return Py_IsFinalizing();
#else
  return _Py_IsFinalizing();
#endif
}

_PyInterpreterFrame* complete_frame(_PyInterpreterFrame* f) {
  while (f != nullptr && _PyFrame_IsIncomplete(f)) f = f->previous;  // not started yet
  return f;
}

int32_t lasti(_PyInterpreterFrame* f) {
  return static_cast<int32_t>(_PyInterpreterFrame_LASTI(f) * sizeof(_Py_CODEUNIT));
}

}  // namespace

bool CodeTable::add(PyCodeObject* code, bool library) {
  if (used_ >= kMax) return false;
  size_t i = hash(code);
  while (slots_[i].code.load(std::memory_order_relaxed) != nullptr) i = (i + 1) & (kSlots - 1);
  Py_INCREF(code);
  slots_[i].library = library ? LIBRARY : USER;
  slots_[i].code.store(code, std::memory_order_release);  // published with its verdict
  ++used_;
  return true;
}

// Only a thread that runs Python has a stack (DDP's autograd thread on GPU has none). No GIL:
// only this thread changes its frames, and while it is in here they hold still, each holding
// its code. The GIL is taken only for a code object the table has not met yet (to hold it, and
// to ask Python whether it is a library's).
void Stacks::capture(std::vector<FrameRef>& out) {
  out.clear();
  if (depth_ <= 0 || !Py_IsInitialized() || finalizing()) return;
  PyThreadState* ts = PyGILState_GetThisThreadState();
  if (ts == nullptr || ts->cframe == nullptr) return;
  if (walk(ts->cframe->current_frame, out, false)) return;
  PyGILState_STATE st = PyGILState_Ensure();
  walk(ts->cframe->current_frame, out, true);
  PyGILState_Release(st);
}

// False (out cleared) at a code object the table lacks, unless `gil`: then it is added.
bool Stacks::walk(_PyInterpreterFrame* f, std::vector<FrameRef>& out, bool gil) {
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
  f = complete_frame(f);
  for (int depth = depth_; f != nullptr && depth > 0; --depth) {
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
int8_t Stacks::meet(PyCodeObject* code) {
  int8_t verdict = codes_.get(code);  // another thread may have met it meanwhile
  if (verdict != CodeTable::UNKNOWN) return verdict;
  PyObject* r = PyObject_CallFunctionObjArgs(is_library_.ptr(), code->co_filename, nullptr);
  bool library = r != nullptr && PyObject_IsTrue(r) == 1;
  if (r == nullptr) PyErr_Clear();
  Py_XDECREF(r);
  if (!codes_.add(code, library)) {
    full_.store(true, std::memory_order_relaxed);
    return CodeTable::UNKNOWN;
  }
  return library ? CodeTable::LIBRARY : CodeTable::USER;
}

}  // namespace tether
