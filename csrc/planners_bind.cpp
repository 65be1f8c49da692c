// Bindings of the planners beyond post-balancing (dynamic CP groups, microbatch reordering,
// ISF batching, pipeline partitioning). Called from bindings.cpp.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

namespace py = pybind11;

namespace mmb {

void bind_planners(py::module_& m) { (void)m; }

}  // namespace mmb
