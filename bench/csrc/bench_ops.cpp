// C++ pieces of bench/recorder_overhead.py, built at bench time with torch.utils.cpp_extension.
//
// - NullBackend: a synchronous c10d::Backend with no thread and no communication; its works are
//   complete when returned. It isolates the issue path's cost from a real backend's noise (gloo
//   hands every op to a worker thread: 1-20 us of jitter per op on a shared machine).
// - allreduce_loop: N blocking allreduces issued from C++ with the GIL released, as DDP's reducer
//   issues them; a Python ProcessGroup subclass pays the pybind trampoline and the GIL here.
// - FlightRecorder toggle: torch's own recorder, switched on and off inside one process, so it is
//   compared in the same process as everything else (TORCH_FR_BUFFER_SIZE is read only once).

#include <dlfcn.h>
#include <elf.h>
#include <fcntl.h>
#include <link.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include <ATen/core/ivalue.h>
#include <c10/core/Event.h>
#include <torch/csrc/distributed/c10d/Backend.hpp>
#include <torch/csrc/distributed/c10d/FlightRecorder.hpp>
#include <torch/csrc/distributed/c10d/ProcessGroup.hpp>
#include <torch/csrc/distributed/c10d/Work.hpp>
#include <torch/csrc/utils/pybind.h>

#include <atomic>
#include <chrono>
#include <cstring>
#include <string>
#include <vector>

namespace py = pybind11;

namespace bench {

class NullWork : public c10d::Work {
 public:
  explicit NullWork(std::vector<at::Tensor> tensors)
      : c10d::Work(-1, c10d::OpType::UNKNOWN), tensors_(std::move(tensors)) {}
  bool isCompleted() override { return true; }
  bool isSuccess() const override { return true; }
  bool wait(std::chrono::milliseconds) override { return true; }
  std::vector<at::Tensor> result() override { return tensors_; }
  // Built only when asked (DDP's reducer does): most callers only wait.
  c10::intrusive_ptr<c10::ivalue::Future> getFuture() override {
    auto f = c10::make_intrusive<c10::ivalue::Future>(
        c10::ListType::create(c10::TensorType::get()));
    f->markCompleted(c10::IValue(tensors_));
    return f;
  }

 private:
  std::vector<at::Tensor> tensors_;
};

// Every rank keeps its own data: enough for timing and for DDP's setup checks (an allgather of
// identical shapes, a broadcast from itself).
class NullBackend : public c10d::Backend {
 public:
  NullBackend(int rank, int size) : c10d::Backend(rank, size) {}
  const std::string getBackendName() const override { return "benchnull"; }
  int64_t calls() const { return calls_.load(std::memory_order_relaxed); }

  c10::intrusive_ptr<c10d::Work> allreduce(std::vector<at::Tensor>& t,
                                           const c10d::AllreduceOptions&) override {
    return done(t);
  }
  c10::intrusive_ptr<c10d::Work> allreduce_coalesced(
      std::vector<at::Tensor>& t, const c10d::AllreduceCoalescedOptions&) override {
    return done(t);
  }
  c10::intrusive_ptr<c10d::Work> broadcast(std::vector<at::Tensor>& t,
                                           const c10d::BroadcastOptions&) override {
    return done(t);
  }
  c10::intrusive_ptr<c10d::Work> reduce(std::vector<at::Tensor>& t,
                                        const c10d::ReduceOptions&) override {
    return done(t);
  }
  c10::intrusive_ptr<c10d::Work> allgather(std::vector<std::vector<at::Tensor>>& out,
                                           std::vector<at::Tensor>& in,
                                           const c10d::AllgatherOptions&) override {
    for (size_t i = 0; i < out.size() && i < in.size(); ++i) {
      for (auto& o : out[i]) o.copy_(in[i]);
    }
    return done(in);
  }
  c10::intrusive_ptr<c10d::Work> _allgather_base(at::Tensor& out, at::Tensor& in,
                                                 const c10d::AllgatherOptions&) override {
    out.view({-1, in.numel()}).copy_(in.reshape({1, -1}));
    std::vector<at::Tensor> v{out};
    return done(v);
  }
  c10::intrusive_ptr<c10d::Work> _reduce_scatter_base(at::Tensor& out, at::Tensor& in,
                                                      const c10d::ReduceScatterOptions&) override {
    out.copy_(in.reshape({-1}).narrow(0, 0, out.numel()).view_as(out));
    std::vector<at::Tensor> v{out};
    return done(v);
  }
  c10::intrusive_ptr<c10d::Work> barrier(const c10d::BarrierOptions&) override {
    std::vector<at::Tensor> none;
    return done(none);
  }

 private:
  c10::intrusive_ptr<c10d::Work> done(std::vector<at::Tensor>& t) {
    calls_.fetch_add(1, std::memory_order_relaxed);
    return c10::make_intrusive<NullWork>(t);
  }
  std::atomic<int64_t> calls_{0};
};

int64_t thread_cpu_ns() {
  timespec ts;
  clock_gettime(CLOCK_THREAD_CPUTIME_ID, &ts);
  return static_cast<int64_t>(ts.tv_sec) * 1000000000 + ts.tv_nsec;
}

int64_t mono_ns() {
  return std::chrono::duration_cast<std::chrono::nanoseconds>(
             std::chrono::steady_clock::now().time_since_epoch())
      .count();
}

// (wall ns, this thread's CPU ns, slowest single op ns) for n allreduces, each waited, issued
// through the group's C++ virtual method with the GIL released (DDP's reducer does the same).
py::tuple allreduce_loop(const c10::intrusive_ptr<c10d::ProcessGroup>& pg, at::Tensor tensor,
                         int64_t n) {
  std::vector<at::Tensor> tensors{std::move(tensor)};
  int64_t wall = 0, cpu = 0, worst = 0;
  {
    py::gil_scoped_release nogil;
    int64_t c0 = thread_cpu_ns(), t0 = mono_ns(), prev = t0;
    for (int64_t i = 0; i < n; ++i) {
      pg->allreduce(tensors)->wait();
      int64_t now = mono_ns();
      worst = std::max(worst, now - prev);
      prev = now;
    }
    wall = prev - t0;
    cpu = thread_cpu_ns() - c0;
  }
  return py::make_tuple(wall, cpu, worst);
}

// -- torch's flight recorder, toggled in-process ----------------------------------------------
// FlightRecorder<c10::Event>::get() keeps its instance in a function-local static that libtorch
// does not export (each library inlining get() would get its own copy), so it is looked up in
// libtorch_cpu's symbol table, by name, and checked against what the environment configured.

using FR = c10d::FlightRecorder<c10::Event>;
const char* const kInstance = "_ZZN4c10d14FlightRecorderIN3c105EventEE3getEvE8instance";

struct Lib {
  std::string path;
  uintptr_t base = 0;
};

int find_torch_cpu(dl_phdr_info* info, size_t, void* data) {
  if (info->dlpi_name != nullptr && std::strstr(info->dlpi_name, "/libtorch_cpu.so") != nullptr) {
    auto* lib = static_cast<Lib*>(data);
    lib->path = info->dlpi_name;
    lib->base = info->dlpi_addr;
    return 1;
  }
  return 0;
}

// The address of the static's slot in this process; 0 and why where it cannot be found.
uintptr_t symbol_address(const Lib& lib, const char* name, std::string& why) {
  int fd = open(lib.path.c_str(), O_RDONLY);
  if (fd < 0) { why = "cannot open " + lib.path; return 0; }
  struct stat st;
  fstat(fd, &st);
  void* map = mmap(nullptr, st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
  close(fd);
  if (map == MAP_FAILED) { why = "cannot map " + lib.path; return 0; }
  auto* base = static_cast<const char*>(map);
  auto* eh = reinterpret_cast<const Elf64_Ehdr*>(base);
  uintptr_t found = 0;
  if (std::memcmp(eh->e_ident, ELFMAG, SELFMAG) != 0 || eh->e_ident[EI_CLASS] != ELFCLASS64) {
    why = "not a 64-bit ELF file";
  } else {
    auto* sh = reinterpret_cast<const Elf64_Shdr*>(base + eh->e_shoff);
    why = "libtorch_cpu has no symbol table (stripped)";
    for (int i = 0; i < eh->e_shnum && found == 0; ++i) {
      if (sh[i].sh_type != SHT_SYMTAB) continue;
      why = "torch's recorder instance is not in libtorch_cpu's symbol table";
      const char* strtab = base + sh[sh[i].sh_link].sh_offset;
      auto* syms = reinterpret_cast<const Elf64_Sym*>(base + sh[i].sh_offset);
      size_t count = sh[i].sh_size / sizeof(Elf64_Sym);
      for (size_t k = 0; k < count; ++k) {
        if (std::strcmp(strtab + syms[k].st_name, name) == 0) {
          found = lib.base + syms[k].st_value;
          break;
        }
      }
    }
  }
  munmap(map, st.st_size);
  return found;
}

FR* g_fr = nullptr;

// Finds torch's recorder (call after one gloo op, which creates it); "" once found, else why not.
std::string fr_find() {
  if (g_fr != nullptr) return "";
  Lib lib;
  dl_iterate_phdr(find_torch_cpu, &lib);
  if (lib.path.empty()) return "libtorch_cpu is not loaded";
  std::string why;
  uintptr_t slot = symbol_address(lib, kInstance, why);
  if (slot == 0) return why;
  FR* fr = *reinterpret_cast<FR**>(slot);
  if (fr == nullptr) return "torch's recorder is not created yet (no gloo operation so far)";
  // Guard against a layout or a symbol that is not what this header says.
  const char* env = std::getenv("TORCH_FR_BUFFER_SIZE");
  size_t want = env != nullptr ? static_cast<size_t>(std::atoll(env)) : 2000;
  if (fr->max_entries_ != want || fr->enabled_ != (want > 0)) {
    return "torch's recorder found does not look like the configured one (max_entries " +
           std::to_string(fr->max_entries_) + ", expected " + std::to_string(want) + ")";
  }
  g_fr = fr;
  return "";
}

// Turns torch's recorder on or off (its only gate, as TORCH_FR_BUFFER_SIZE=0 makes it false).
void fr_set(bool on) {
  TORCH_CHECK(g_fr != nullptr, "fr_find() first");
  TORCH_CHECK(!on || g_fr->max_entries_ > 0, "torch's recorder has no buffer");
  g_fr->enabled_ = on;
}

int64_t fr_recorded() {  // entries recorded so far (ids given out)
  return g_fr == nullptr ? -1 : static_cast<int64_t>(g_fr->id_);
}

}  // namespace bench

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace bench;
  py::module_::import("torch.distributed");  // c10d::Backend's Python type
  py::class_<NullBackend, c10d::Backend, c10::intrusive_ptr<NullBackend>>(m, "NullBackend")
      .def(py::init<int, int>())
      .def("calls", &NullBackend::calls);
  m.def("allreduce_loop", &allreduce_loop);
  m.def("fr_find", &fr_find);
  m.def("fr_set", &fr_set);
  m.def("fr_recorded", &fr_recorded);
}
