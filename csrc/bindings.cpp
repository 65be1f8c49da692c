// pybind11 bindings of the planner core: ``mmbalance._core``.
//
// Arrays cross the boundary as contiguous int64/float64 numpy arrays; the GIL is released while
// planning so a background planning thread overlaps the training step.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>

#include <stdexcept>
#include <string>
#include <vector>

#include "accum.hpp"
#include "additive.hpp"
#include "balance.hpp"
#include "conv.hpp"
#include "exact_search.hpp"
#include "helper_thread.hpp"
#include "locality.hpp"
#include "node_perm.hpp"
#include "padded.hpp"
#include "placer.hpp"

namespace py = pybind11;
using mmb::Index;

namespace mmb {
void bind_planners(py::module_& m);  // schedulers_bind.cpp
}

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;

// Hand a vector's buffer to numpy without a copy: the array owns the vector through a capsule.
template <class T>
py::array_t<T> to_array(std::vector<T>&& v) {
  auto* owner = new std::vector<T>(std::move(v));
  py::capsule free_when_done(owner, [](void* p) { delete static_cast<std::vector<T>*>(p); });
  return py::array_t<T>(static_cast<py::ssize_t>(owner->size()), owner->data(), free_when_done);
}

template <class T>
py::array_t<T> to_array(const std::vector<T>& v) {
  return to_array(std::vector<T>(v));
}

void check_common(const I64& lengths, Index d) {
  if (lengths.ndim() != 1) throw std::invalid_argument("lengths must be 1-D");
  if (d < 1) throw std::invalid_argument("num_ranks must be >= 1");
  const int64_t* l = lengths.data();
  for (py::ssize_t i = 0; i < lengths.shape(0); ++i)
    if (l[i] < 0) throw std::invalid_argument("lengths must be non-negative");
}

void check_ranks(const I64& a, py::ssize_t n, Index d, const char* name) {
  if (a.ndim() != 1 || a.shape(0) != n)
    throw std::invalid_argument(std::string(name) + " must be 1-D with one entry per example");
  for (py::ssize_t i = 0; i < n; ++i)
    if (a.data()[i] < 0 || a.data()[i] >= d) throw std::invalid_argument(std::string(name) + " out of range");
}

// Lengths, one rank array named `name` and the source ranks of the same examples, and nodes of
// `rpn` ranks (>= 1, dividing d): returns the number of examples.
Index check_per_example(const I64& lengths, const I64& a, const char* name, const I64& src, Index d, Index rpn) {
  check_common(lengths, d);
  const Index n = lengths.shape(0);
  check_ranks(a, n, d, name);
  check_ranks(src, n, d, "src_ranks");
  if (rpn < 1 || d % rpn != 0) throw std::invalid_argument("ranks_per_node must divide num_ranks");
  return n;
}

mmb::CostModel model(int policy, double alpha, double beta) {
  if (policy < 0 || policy > 4) throw std::invalid_argument("unknown policy");
  return mmb::CostModel{static_cast<mmb::Policy>(policy), alpha, beta};
}

std::vector<Index> slots_of(const std::vector<Index>& dst, Index d) {
  std::vector<Index> next(d, 0), slot(dst.size());
  for (size_t i = 0; i < dst.size(); ++i) slot[i] = next[dst[i]]++;
  return slot;
}

// Slots in (source rank, index) order: what an all-to-all receive buffer holds, so no reordering
// is needed after the exchange; and each example's slot among its source rank's (index order).
// Sources in rank-major order (what gather_lengths gives) need no sort at all.
void slots_by_source(const Index* dst, size_t n, const Index* src, Index d, Index* slot, Index* src_slot) {
  bool sorted = true;
  for (size_t i = 1; i < n && sorted; ++i) sorted = src[i - 1] <= src[i];
  std::vector<Index> next(d, 0);
  if (sorted) {
    for (size_t i = 0; i < n; ++i) slot[i] = next[dst[i]]++;
    for (size_t i = 0; i < n; ++i) src_slot[i] = (i > 0 && src[i] == src[i - 1]) ? src_slot[i - 1] + 1 : 0;
    return;
  }
  std::vector<Index> start(d + 1, 0), order(n);
  for (size_t i = 0; i < n; ++i) ++start[src[i] + 1];
  for (Index r = 0; r < d; ++r) start[r + 1] += start[r];
  for (size_t i = 0; i < n; ++i) order[start[src[i]]++] = static_cast<Index>(i);
  for (Index i : order) slot[i] = next[dst[i]]++;
  std::fill(next.begin(), next.end(), 0);
  for (size_t i = 0; i < n; ++i) src_slot[i] = next[src[i]]++;
}

}  // namespace

PYBIND11_MODULE(_core, m) {
  m.doc() = "Compiled planners of mmbalance (C++17). Use mmbalance.balancing, not this module.";
  mmb::bind_planners(m);

  m.def(
      "plan",
      [](const I64& lengths, Index d, int policy, double alpha, double beta, py::object src, Index rpn,
         double tolerance, bool checked) -> py::tuple {
        // ``checked``: the caller (mmbalance.balancing) validated lengths and sources already
        if (!checked) check_common(lengths, d);
        const auto cm = model(policy, alpha, beta);
        const Index n = lengths.shape(0);
        std::vector<Index> dst;
        std::vector<double> costs;
        if (src.is_none()) {
          py::array_t<Index> dst_a(n), slot_a(n);  // numpy-allocated, as below
          Index* dp = dst_a.mutable_data();
          Index* sp = slot_a.mutable_data();
          {
            py::gil_scoped_release nogil;
            dst = mmb::balance(lengths.data(), n, d, cm);
            std::copy(dst.begin(), dst.end(), dp);
            std::vector<Index> next(d, 0);
            for (Index i = 0; i < n; ++i) sp[i] = next[dp[i]]++;
            costs = mmb::batch_costs(lengths.data(), n, dp, d, cm);
          }
          return py::make_tuple(dst_a, slot_a, to_array(std::move(costs)), py::none());
        }
        I64 s = src.cast<I64>();
        if (!checked) check_ranks(s, n, d, "src_ranks");
        if (rpn < 0 || (rpn > 0 && d % rpn != 0)) throw std::invalid_argument("ranks_per_node must divide num_ranks");
        // outputs allocated by numpy (huge pages where the system offers them: a fresh multi-megabyte
        // buffer otherwise costs thousands of page faults per call) and written in place
        py::array_t<Index> dst_a(n), slot_a(n), src_slot_a(n);
        Index* dp = dst_a.mutable_data();
        Index* sp = slot_a.mutable_data();
        Index* ssp = src_slot_a.mutable_data();
        {
          py::gil_scoped_release nogil;
          mmb::balance_local(lengths.data(), n, d, cm, s.data(), rpn, tolerance, dp);
          if (n >= 100000) {  // two independent passes over the plan: one each on two threads
            mmb::run_beside([&] { costs = mmb::batch_costs(lengths.data(), n, dp, d, cm); },
                            [&] { slots_by_source(dp, static_cast<size_t>(n), s.data(), d, sp, ssp); });
          } else {
            slots_by_source(dp, static_cast<size_t>(n), s.data(), d, sp, ssp);
            costs = mmb::batch_costs(lengths.data(), n, dp, d, cm);
          }
        }
        return py::make_tuple(dst_a, slot_a, to_array(std::move(costs)), src_slot_a);
      },
      py::arg("lengths"), py::arg("num_ranks"), py::arg("policy"), py::arg("alpha"), py::arg("beta"),
      py::arg("src_ranks"), py::arg("ranks_per_node"), py::arg("tolerance"), py::arg("checked") = false,
      "Plan one phase: returns (dst_rank, dst_slot, costs, src_slot or None).");

  m.def(
      "plan_accum",
      [](const I64& lengths, Index steps, Index n, Index d, Index g, int policy, double alpha, double beta,
         bool padded) -> py::tuple {
        check_common(lengths, d);
        if (g < 1) throw std::invalid_argument("grad_accum must be >= 1");
        if (steps < 0 || n < 0 || lengths.shape(0) != steps * n)
          throw std::invalid_argument("lengths must hold steps * n entries");
        const auto cm = model(policy, alpha, beta);
        py::array_t<Index> rank_a(steps * n), micro_a(steps * n);
        py::array_t<double> costs_a({steps, g, d});
        Index* rp = rank_a.mutable_data();
        Index* mp = micro_a.mutable_data();
        double* cp = costs_a.mutable_data();
        {
          py::gil_scoped_release nogil;
          mmb::plan_accum(lengths.data(), steps, n, d, g, cm, padded, rp, mp, cp);
        }
        return py::make_tuple(rank_a, micro_a, costs_a);
      },
      py::arg("lengths"), py::arg("steps"), py::arg("n"), py::arg("num_ranks"), py::arg("grad_accum"),
      py::arg("policy"), py::arg("alpha"), py::arg("beta"), py::arg("padded"),
      "Plan steps of n examples each into grad_accum micro-batches per rank: (rank, micro, costs[steps, g, d]).");

  m.def(
      "batch_costs",
      [](const I64& lengths, const I64& dst, Index d, int policy, double alpha, double beta) {
        check_common(lengths, d);
        check_ranks(dst, lengths.shape(0), d, "dst_rank");
        return to_array(mmb::batch_costs(lengths.data(), lengths.shape(0), dst.data(), d, model(policy, alpha, beta)));
      },
      py::arg("lengths"), py::arg("dst_rank"), py::arg("num_ranks"), py::arg("policy"), py::arg("alpha"),
      py::arg("beta"));

  m.def(
      "slots",
      [](const I64& dst, Index d, py::object src) {
        check_ranks(dst, dst.shape(0), d, "dst_rank");
        std::vector<Index> v(dst.data(), dst.data() + dst.shape(0));
        if (src.is_none()) return to_array(slots_of(v, d));
        I64 s = src.cast<I64>();
        check_ranks(s, dst.shape(0), d, "src_ranks");
        std::vector<Index> slot(v.size()), src_slot(v.size());
        slots_by_source(v.data(), v.size(), s.data(), d, slot.data(), src_slot.data());
        return to_array(std::move(slot));
      },
      py::arg("dst_rank"), py::arg("num_ranks"), py::arg("src_ranks") = py::none(),
      "Slot of each example among its rank's examples: index order, or (source rank, index) order.");

  m.def(
      "node_permutation",
      [](const I64& lengths, const I64& batch, const I64& src, Index d, Index rpn, Index max_iters) {
        check_common(lengths, d);
        const Index n = lengths.shape(0);
        check_ranks(batch, n, d, "batch");
        check_ranks(src, n, d, "src_ranks");
        if (rpn < 1 || d % rpn != 0) throw std::invalid_argument("ranks_per_node must divide num_ranks");
        std::vector<Index> perm;
        {
          py::gil_scoped_release nogil;
          perm = mmb::node_permutation(lengths.data(), n, batch.data(), src.data(), d, rpn, max_iters);
        }
        return to_array(perm);
      },
      py::arg("lengths"), py::arg("batch"), py::arg("src_ranks"), py::arg("num_ranks"), py::arg("ranks_per_node"),
      py::arg("max_iters"), "Batch -> rank permutation minimizing the worst off-node send (heuristic).");

  m.def(
      "place_within_nodes",
      [](const I64& lengths, const I64& batch, const I64& src, Index d, Index rpn, const I64& node_of_batch) {
        check_common(lengths, d);
        const Index n = lengths.shape(0);
        check_ranks(batch, n, d, "batch");
        check_ranks(src, n, d, "src_ranks");
        if (rpn < 1 || d % rpn != 0) throw std::invalid_argument("ranks_per_node must divide num_ranks");
        check_ranks(node_of_batch, d, d / rpn, "node_of_batch");
        std::vector<Index> nob(node_of_batch.data(), node_of_batch.data() + d);
        return to_array(mmb::place_within_nodes(lengths.data(), n, batch.data(), src.data(), d, rpn, nob));
      },
      py::arg("lengths"), py::arg("batch"), py::arg("src_ranks"), py::arg("num_ranks"), py::arg("ranks_per_node"),
      py::arg("node_of_batch"));

  // The best-fit index of the locality planner, exposed for tests: ``ops`` rows (rank, weight);
  // rank -1 places the weight on the best-fitting rank (returned, -1 if none fits), rank r >= 0
  // adds the weight (negative: removes) to r's load.
  m.def(
      "_best_fit_sequence",
      [](const py::array_t<double, py::array::c_style | py::array::forcecast>& loads, double T, const I64& ranks,
         const py::array_t<double, py::array::c_style | py::array::forcecast>& weights) {
        if (loads.ndim() != 1 || ranks.ndim() != 1 || weights.ndim() != 1 || ranks.shape(0) != weights.shape(0))
          throw std::invalid_argument("loads, ranks and weights must be 1-D; ranks and weights of one length");
        std::vector<double> load(loads.data(), loads.data() + loads.shape(0));
        const Index d = static_cast<Index>(load.size());
        mmb::BestFit index;
        index.build(T, load);
        std::vector<Index> out;
        for (py::ssize_t k = 0; k < ranks.shape(0); ++k) {
          const Index r = ranks.data()[k];
          const double wk = weights.data()[k];
          if (r >= d || r < -1) throw std::invalid_argument("ranks out of range");
          if (r >= 0) {
            const double before = load[r];
            load[r] += wk;
            index.update(r, before, load[r]);
            continue;
          }
          mmb::BestFit::Pos pos;
          const Index to = index.find(wk, pos);
          out.push_back(to);
          if (to >= 0) load[to] += wk, index.lower(pos, T - load[to]);
        }
        return to_array(std::move(out));
      },
      py::arg("loads"), py::arg("target"), py::arg("ranks"), py::arg("weights"));

  // Whole groups onto ranks (the located plan of the non-additive policies), exposed for tests.
  m.def(
      "_assign_groups",
      [](const I64& lengths, const I64& group, const I64& src, Index d, Index rpn) {
        const Index n = check_per_example(lengths, group, "group", src, d, rpn);
        return to_array(mmb::assign_groups(lengths.data(), n, group.data(), src.data(), d, rpn));
      },
      py::arg("lengths"), py::arg("group"), py::arg("src_ranks"), py::arg("num_ranks"), py::arg("ranks_per_node"));

  // The exchange of equal-length examples toward home, exposed for tests: returns the new dst.
  m.def(
      "_keep_equal_lengths_home",
      [](const I64& lengths, const I64& src, const I64& dst, Index d, Index rpn) {
        const Index n = check_per_example(lengths, dst, "dst_rank", src, d, rpn);
        std::vector<Index> out(dst.data(), dst.data() + n);
        mmb::keep_equal_lengths_home(lengths.data(), n, d, src.data(), rpn, out.data());
        return to_array(std::move(out));
      },
      py::arg("lengths"), py::arg("src_ranks"), py::arg("dst_rank"), py::arg("num_ranks"), py::arg("ranks_per_node"));

  // The "conv" local search and the bound on what it can reach, exposed for tests: returns
  // (the refined plan, refine_floor of the given one).
  m.def(
      "_refine_conv",
      [](const I64& lengths, const I64& dst, Index d, double alpha, double beta, Index iters) {
        check_common(lengths, d);
        const Index n = lengths.shape(0);
        check_ranks(dst, n, d, "dst_rank");
        if (iters < 0) throw std::invalid_argument("iters must be >= 0");
        const mmb::CostModel cm = model(3, alpha, beta);
        std::vector<Index> plan(dst.data(), dst.data() + n);
        const double floor = mmb::refine_floor(lengths.data(), n, d, cm, plan, iters);
        mmb::refine_general(lengths.data(), n, d, cm, plan, iters);
        return py::make_tuple(to_array(std::move(plan)), floor);
      },
      py::arg("lengths"), py::arg("dst_rank"), py::arg("num_ranks"), py::arg("alpha"), py::arg("beta"),
      py::arg("iters"));

  // Reference algorithms of the paper, exposed for tests and benchmarks.
  m.def(
      "paper_algorithm",
      [](const I64& lengths, Index d, int alg) {
        check_common(lengths, d);
        const Index n = lengths.shape(0);
        std::vector<Index> dst;
        py::gil_scoped_release nogil;
        if (alg == 1) {
          std::vector<double> w(lengths.data(), lengths.data() + n);
          dst = mmb::lpt(w.data(), mmb::order_by_length_desc(lengths.data(), n), d);
        } else if (alg == 2) {
          dst = mmb::paper_padded(lengths.data(), n, d);
        } else if (alg == 5) {
          dst = mmb::paper_conv(lengths.data(), n, d);
        } else {
          throw std::invalid_argument("alg must be 1, 2 or 5");
        }
        py::gil_scoped_acquire gil;
        return to_array(dst);
      },
      py::arg("lengths"), py::arg("num_ranks"), py::arg("alg"));
}
