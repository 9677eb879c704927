// The Python module (tether._native_<torch release>): what tether/recorder/native.py calls,
// typed for it in tether/recorder/native_core.py (a test keeps the two alike).

#include <torch/csrc/utils/pybind.h>

#include "backend.h"
#include "core.h"
#include "ring_file.h"

namespace py = pybind11;

namespace {

// The ring record's layout as ringfile.RECORD_LAYOUT spells it, for native.py to compare.
py::dict record_layout() {
  py::list fields;
  for (const tether::layout::Field& f : tether::layout::kFields) {
    fields.append(py::make_tuple(f.name, f.offset, f.size));
  }
  py::dict out;
  out["version"] = tether::layout::kVersion;
  out["record_size"] = tether::layout::kRecordSize;
  out["fields"] = fields;
  return out;
}

}  // namespace

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  using namespace tether;
  py::module_::import("torch.distributed");  // c10d::Backend's and Work's Python types
  m.attr("ABI") = 7;  // native.py's ABI: the interface between this module and it
  m.attr("TORCH_VERSION") = std::to_string(TORCH_VERSION_MAJOR) + "." +
                            std::to_string(TORCH_VERSION_MINOR) + "." +
                            std::to_string(TORCH_VERSION_PATCH);
  m.attr("RECORD_LAYOUT") = record_layout();
  py::class_<Core, std::shared_ptr<Core>>(m, "Core")
      .def(py::init<size_t, int, py::object, int, int64_t, const std::string&, size_t>(),
           py::arg("capacity"), py::arg("stack_depth"), py::arg("is_library"),
           py::arg("walk_on"), py::arg("p2p_seq_base"), py::arg("ring_path"), py::arg("records_at"))
      .def_property_readonly("ring_file_open", &Core::ring_file_open)
      .def("add_group", &Core::add_group, py::arg("rank"))
      .def("reap", &Core::reap, py::arg("min_age_ns"), py::call_guard<py::gil_scoped_release>())
      .def("inflight", &Core::inflight, py::call_guard<py::gil_scoped_release>())
      .def("oldest_inflight", &Core::oldest_inflight, py::call_guard<py::gil_scoped_release>())
      .def("suspect", &Core::suspect, py::arg("gid"))
      .def("snapshot", &Core::snapshot, py::arg("only") = std::vector<int64_t>{})
      .def("group_status", &Core::group_status, py::arg("gid"))
      .def("regroup", &Core::regroup, py::arg("gid"), py::arg("rank"))
      .def("last_done", &Core::last_done, py::arg("gid"))
      .def("forget_last_done", &Core::forget_last_done, py::arg("gid"), py::arg("rid"))
      .def("mark_failed", &Core::mark_failed, py::arg("rid"), py::arg("error"))
      .def("finish", &Core::finish, py::arg("rid"), py::call_guard<py::gil_scoped_release>())
      .def("set_stack_depth", &Core::set_stack_depth, py::arg("depth"))
      .def("bugs", &Core::bugs)
      .def("fail_next", &Core::fail_next, py::arg("what"), py::arg("n"))
      .def_property_readonly("capacity", &Core::capacity);
  py::class_<RecordingBackend, c10d::Backend, c10::intrusive_ptr<RecordingBackend>>(
      m, "RecordingBackend")
      .def(py::init<std::shared_ptr<Core>, int32_t, int, int, Inners, const std::string&>(),
           py::arg("core"), py::arg("gid"), py::arg("rank"), py::arg("size"), py::arg("inners"),
           py::arg("default_device"))
      .def("inner", &RecordingBackend::inner, py::arg("device"))
      .def("set_ready", &RecordingBackend::set_ready, py::arg("ready"))
      .def_property_readonly("attached", &RecordingBackend::attached)
      .def("attach", &RecordingBackend::attach, py::arg("gid"))
      .def("replace", &RecordingBackend::replace, py::arg("backend"), py::arg("rank"),
           py::arg("size"))
      // What torch and libraries call on a backend of a known type (gloo's
      // _set_default_timeout, NCCL's options, ...): answered by the backend it wraps.
      .def("__getattr__", [](RecordingBackend& self, const std::string& name) {
        return py::getattr(py::cast(self.inner("")), name.c_str());
      });
}
