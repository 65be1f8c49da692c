// Bindings of the planners beyond post-balancing (dynamic CP groups, microbatch reordering,
// ISF batching, pipeline partitioning, resource allocation). Called from bindings.cpp.
//
// Inputs are validated in Python (mmbalance.balancing); the checks here only keep a bad call from
// reading out of bounds. Long calls release the GIL.
#include <pybind11/numpy.h>
#include <pybind11/pybind11.h>
#include <pybind11/stl.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <stdexcept>
#include <string>

#include "schedulers.hpp"

namespace py = pybind11;

namespace mmb {

namespace {

using I64 = py::array_t<int64_t, py::array::c_style | py::array::forcecast>;
using F64 = py::array_t<double, py::array::c_style | py::array::forcecast>;

I64 to_i64(const std::vector<Index>& v) {
  I64 out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

F64 to_f64(const std::vector<double>& v) {
  F64 out(static_cast<py::ssize_t>(v.size()));
  std::copy(v.begin(), v.end(), out.mutable_data());
  return out;
}

void need_1d(const py::array& a, const char* name) {
  if (a.ndim() != 1) throw std::invalid_argument(std::string(name) + " must be 1-D");
}

// The per-sequence extra seconds of the CP planners: null, or [n] finite and >= 0.
const double* checked_extra(const std::optional<F64>& extra, Index n) {
  if (!extra) return nullptr;
  if (extra->ndim() != 1 || extra->shape(0) != n) throw std::invalid_argument("extra must be [len(lengths)]");
  for (Index i = 0; i < n; ++i)
    if (!(extra->data()[i] >= 0.0) || !std::isfinite(extra->data()[i]))
      throw std::invalid_argument("extra must be finite and >= 0");
  return extra->data();
}

// [l, p] times of a pipeline, forward and backward of the same shape.
void need_times(const F64& f, const F64& b) {
  if (f.ndim() != 2 || b.ndim() != 2 || f.shape(0) != b.shape(0) || f.shape(1) != b.shape(1))
    throw std::invalid_argument("stage times must be 2-D [microbatches, stages] of one shape");
}

void check_blocks(const I64& order, const I64& offsets, Index n) {
  need_1d(order, "order");
  need_1d(offsets, "offsets");
  if (order.shape(0) != n) throw std::invalid_argument("order must have one entry per microbatch");
  const Index* o = offsets.data();
  if (offsets.shape(0) < 1 || o[0] != 0 || o[offsets.shape(0) - 1] != n)
    throw std::invalid_argument("offsets must start at 0 and end at the number of microbatches");
  for (py::ssize_t k = 1; k < offsets.shape(0); ++k)
    if (o[k] < o[k - 1]) throw std::invalid_argument("offsets must be non-decreasing");
  for (Index i = 0; i < n; ++i)
    if (order.data()[i] < 0 || order.data()[i] >= n) throw std::invalid_argument("order out of range");
}

py::dict cp_result(const CpResult& r) {
  py::dict out;
  out["group_of"] = to_i64(r.group_of);
  {  // every group's sequences, ascending, one group after another (a counting sort)
    const size_t g = r.degree.size();
    std::vector<Index> offset(g + 1, 0), members(r.group_of.size());
    for (Index k : r.group_of) ++offset[k + 1];
    for (size_t k = 0; k < g; ++k) offset[k + 1] += offset[k];
    std::vector<Index> at(offset.begin(), offset.end() - 1);
    for (size_t i = 0; i < r.group_of.size(); ++i) members[at[r.group_of[i]]++] = static_cast<Index>(i);
    out["members"] = to_i64(members);
    out["member_offset"] = to_i64(offset);
  }
  out["degree"] = to_i64(r.degree);
  out["rank_offset"] = to_i64(r.rank_offset);
  out["ranks"] = to_i64(r.ranks);
  out["time"] = to_f64(r.time);
  out["makespan"] = r.makespan;
  out["static_makespan"] = r.static_makespan;
  out["static_degree"] = r.static_degree;
  out["paper_makespan"] = r.paper_makespan;
  out["lower_bound"] = r.lower_bound;
  out["method"] = r.method;
  return out;
}

}  // namespace

void bind_planners(py::module_& m) {
  // --- dynamic CP groups ---------------------------------------------------------------------
  m.def(
      "cp_schedule",
      [](const I64& lengths, Index num_ranks, int64_t mem, double linear, double attn, double ring,
         double ring_latency, double fixed, bool overlap, Index ranks_per_node, Index max_rounds,
         const std::optional<F64>& extra) {
        need_1d(lengths, "lengths");
        if (num_ranks < 1 || mem < 1) throw std::invalid_argument("num_ranks and memory_per_rank must be >= 1");
        const double* ex = checked_extra(extra, lengths.shape(0));
        CpCost cost{linear, attn, ring, ring_latency, fixed, overlap};
        CpResult r;
        {
          py::gil_scoped_release nogil;
          r = mmb::cp_schedule(lengths.data(), lengths.shape(0), num_ranks, mem, cost, ranks_per_node, max_rounds, ex);
        }
        return cp_result(r);
      },
      py::arg("lengths"), py::arg("num_ranks"), py::arg("memory_per_rank"), py::arg("linear"), py::arg("attn"),
      py::arg("ring"), py::arg("ring_latency"), py::arg("fixed"), py::arg("overlap"), py::arg("ranks_per_node"),
      py::arg("max_rounds"), py::arg("extra") = py::none(),
      "Dynamic CP groups under the built-in cost model (DHP section 4.3 and better); `extra`: each "
      "sequence's further seconds, spread over its group's ranks.");

  m.def(
      "cp_schedule_table",
      [](const I64& lengths, const F64& cost, Index num_ranks, int64_t mem, Index ranks_per_node, Index max_rounds) {
        need_1d(lengths, "lengths");
        if (num_ranks < 1 || mem < 1) throw std::invalid_argument("num_ranks and memory_per_rank must be >= 1");
        const Index n = lengths.shape(0);
        if (cost.ndim() != 2 || cost.shape(0) != n || cost.shape(1) != num_ranks)
          throw std::invalid_argument("cost must be [len(lengths), num_ranks]");
        for (Index j = 0; j < num_ranks * n; ++j)
          if (!(cost.data()[j] >= 0.0) || !std::isfinite(cost.data()[j]))
            throw std::invalid_argument("cost must be finite and >= 0");
        CpResult r;
        {
          py::gil_scoped_release nogil;
          r = cp_schedule_table(lengths.data(), n, num_ranks, mem, cost.data(), ranks_per_node, max_rounds);
        }
        return cp_result(r);
      },
      py::arg("lengths"), py::arg("cost"), py::arg("num_ranks"), py::arg("memory_per_rank"), py::arg("ranks_per_node"),
      py::arg("max_rounds"),
      "Dynamic CP groups under per-sequence times: cost[i, d - 1] is sequence i alone on d ranks, a group "
      "takes the sum over its sequences.");

  m.def(
      "cp_static_groups",
      [](const I64& lengths, Index num_ranks, int64_t mem, double linear, double attn, double ring, double ring_latency,
         double fixed, bool overlap, const I64& degrees, const std::optional<F64>& extra) {
        need_1d(lengths, "lengths");
        need_1d(degrees, "degrees");
        if (num_ranks < 1 || mem < 1) throw std::invalid_argument("num_ranks and memory_per_rank must be >= 1");
        const Index n = lengths.shape(0), k = degrees.shape(0);
        const double* ex = checked_extra(extra, n);
        for (Index j = 0; j < k; ++j)
          if (degrees.data()[j] < 1 || degrees.data()[j] > num_ranks)
            throw std::invalid_argument("degrees out of range");
        CpCost cost{linear, attn, ring, ring_latency, fixed, overlap};
        I64 groups({static_cast<py::ssize_t>(k), static_cast<py::ssize_t>(n)});
        F64 makespan(static_cast<py::ssize_t>(k));
        Index* out = groups.mutable_data();
        double* out_ms = makespan.mutable_data();
        {
          py::gil_scoped_release nogil;
          for (Index j = 0; j < k; ++j) {
            out_ms[j] = -1.0;
            auto g = cp_static_groups(lengths.data(), n, num_ranks, mem, cost, degrees.data()[j], out_ms + j, ex);
            if (g.empty() && n > 0) {
              std::fill(out + j * n, out + (j + 1) * n, Index{-1});
            } else {
              std::copy(g.begin(), g.end(), out + j * n);
            }
          }
        }
        return py::make_tuple(groups, makespan);
      },
      py::arg("lengths"), py::arg("num_ranks"), py::arg("memory_per_rank"), py::arg("linear"), py::arg("attn"),
      py::arg("ring"), py::arg("ring_latency"), py::arg("fixed"), py::arg("overlap"), py::arg("degrees"),
      py::arg("extra") = py::none(),
      "Static uniform degrees: the greedy grouping (longest first, fastest group) of each degree and its "
      "makespan (rows of -1 and makespan -1: a sequence fits nowhere).");

  m.def(
      "bfd_groups",
      [](const I64& lengths, int64_t mem) {
        need_1d(lengths, "lengths");
        if (mem < 1) throw std::invalid_argument("memory_per_rank must be >= 1");
        std::vector<Index> dmin;
        auto g = mmb::bfd_groups(lengths.data(), lengths.shape(0), mem, dmin);
        return py::make_tuple(to_i64(g), to_i64(dmin));
      },
      py::arg("lengths"), py::arg("memory_per_rank"), "Best-fit-decreasing atomic groups (DHP section 4.3 stage 1).");

  auto degrees = [](bool paper) {
    return [paper](const F64& table, const I64& dmin, Index num_ranks) {
      if (table.ndim() != 2 || table.shape(1) != num_ranks + 1 || dmin.ndim() != 1 || dmin.shape(0) != table.shape(0))
        throw std::invalid_argument("table must be [groups, num_ranks + 1] and dmin [groups]");
      for (py::ssize_t k = 0; k < dmin.shape(0); ++k)
        if (dmin.data()[k] < 1 || dmin.data()[k] > num_ranks) throw std::invalid_argument("dmin out of range");
      double ms = 0.0;
      std::vector<Index> d;
      {
        py::gil_scoped_release nogil;
        d = paper ? paper_dp_degrees(table.data(), table.shape(0), num_ranks, dmin.data(), &ms)
                  : optimal_degrees(table.data(), table.shape(0), num_ranks, dmin.data(), &ms);
      }
      return py::make_tuple(to_i64(d), d.empty() && table.shape(0) > 0 ? -1.0 : ms);
    };
  };
  m.def("optimal_degrees", degrees(false), py::arg("table"), py::arg("dmin"), py::arg("num_ranks"),
        "Exact min-max CP degrees for fixed groups (threshold search).");
  m.def("paper_dp_degrees", degrees(true), py::arg("table"), py::arg("dmin"), py::arg("num_ranks"),
        "DHP algorithm 1 (2-D DP, all ranks used).");

  m.def(
      "layout_ranks",
      [](const I64& degree, Index num_ranks, Index rpn) {
        need_1d(degree, "degree");
        std::vector<Index> d(degree.data(), degree.data() + degree.shape(0)), off, ranks;
        Index total = 0;
        for (Index x : d) {
          if (x < 1) throw std::invalid_argument("degrees must be >= 1");
          total += x;
        }
        if (total > num_ranks) throw std::invalid_argument("degrees exceed num_ranks");
        layout_ranks(d, num_ranks, rpn, off, ranks);
        return py::make_tuple(to_i64(off), to_i64(ranks));
      },
      py::arg("degree"), py::arg("num_ranks"), py::arg("ranks_per_node"));

  // --- 1F1B and reordering -------------------------------------------------------------------
  m.def(
      "simulate_1f1b",
      [](const F64& fwd, const F64& bwd, bool schedule) -> py::object {
        need_times(fwd, bwd);
        const Index l = fwd.shape(0), p = fwd.shape(1);
        if (!schedule) {
          double ms;
          {
            py::gil_scoped_release nogil;
            ms = mmb::simulate_1f1b(fwd.data(), bwd.data(), l, p);
          }
          return py::float_(ms);
        }
        F64 fs({l, p}), bs({l, p});
        const double ms = mmb::simulate_1f1b(fwd.data(), bwd.data(), l, p, fs.mutable_data(), bs.mutable_data());
        return py::make_tuple(ms, fs, bs);
      },
      py::arg("fwd"), py::arg("bwd"), py::arg("schedule") = false);

  m.def(
      "simulate_blocks",
      [](const F64& fwd, const F64& bwd, const I64& order, const I64& offsets) {
        need_times(fwd, bwd);
        const Index n = fwd.shape(0), p = fwd.shape(1), g = offsets.shape(0) - 1;
        check_blocks(order, offsets, n);
        std::vector<double> out;
        {
          py::gil_scoped_release nogil;
          out = mmb::simulate_blocks(fwd.data(), bwd.data(), p, order.data(), offsets.data(), g);
        }
        return to_f64(out);
      },
      py::arg("fwd"), py::arg("bwd"), py::arg("order"), py::arg("offsets"),
      "1F1B makespan of every block of `order` (one DP group each).");

  m.def(
      "reorder_blocks",
      [](const F64& fwd, const F64& bwd, const I64& order, const I64& offsets, int method, Index max_evals) {
        need_times(fwd, bwd);
        const Index n = fwd.shape(0), p = fwd.shape(1), g = offsets.shape(0) - 1;
        check_blocks(order, offsets, n);
        if (method < 0 || method > 2) throw std::invalid_argument("method must be 0 (ours), 1 (paper) or 2");
        std::vector<Index> out;
        std::vector<double> times;
        {
          py::gil_scoped_release nogil;
          out = mmb::reorder_blocks(fwd.data(), bwd.data(), p, order.data(), offsets.data(), g, method, max_evals,
                                    &times);
        }
        return py::make_tuple(to_i64(out), to_f64(times));
      },
      py::arg("fwd"), py::arg("bwd"), py::arg("order"), py::arg("offsets"), py::arg("method"), py::arg("max_evals"),
      "(order, block times): inter-microbatch order inside every block: 0 ours, 1 DistTrain algorithm 3, "
      "2 ours without it.");

  m.def(
      "balanced_count_groups",
      [](const F64& w, Index groups, Index max_iters) {
        need_1d(w, "weights");
        if (groups < 1) throw std::invalid_argument("num_groups must be >= 1");
        py::gil_scoped_release nogil;
        auto g = mmb::balanced_count_groups(w.data(), w.shape(0), groups, max_iters);
        py::gil_scoped_acquire gil;
        return to_i64(g);
      },
      py::arg("weights"), py::arg("num_groups"), py::arg("max_iters"));

  m.def(
      "paper_intra_order",
      [](const F64& w, Index groups) {
        need_1d(w, "weights");
        if (groups < 1) throw std::invalid_argument("num_groups must be >= 1");
        return to_i64(mmb::paper_intra_order(w.data(), w.shape(0), groups));
      },
      py::arg("weights"), py::arg("num_groups"), "DistTrain algorithm 2 as written.");

  // --- ISF -----------------------------------------------------------------------------------
  m.def(
      "isf_groups",
      [](const I64& vision, const I64& text, int64_t max_v, int64_t max_t, int64_t min_v, int64_t min_t,
         Index iterations, uint64_t seed, bool pack_leftovers) {
        need_1d(vision, "vision");
        need_1d(text, "text");
        if (vision.shape(0) != text.shape(0)) throw std::invalid_argument("vision and text must have one length");
        IsfParams prm{max_v, max_t, min_v, min_t, iterations, seed, pack_leftovers};
        Index groups = 0, left = 0;
        std::vector<Index> g;
        {
          py::gil_scoped_release nogil;
          g = isf_groups(vision.data(), text.data(), vision.shape(0), prm, &groups, &left);
        }
        return py::make_tuple(to_i64(g), groups, left);
      },
      py::arg("vision"), py::arg("text"), py::arg("max_vision"), py::arg("max_text"), py::arg("min_vision"),
      py::arg("min_text"), py::arg("iterations"), py::arg("seed"), py::arg("pack_leftovers"));

  m.def(
      "permutation", [](Index n, uint64_t seed) { return to_i64(mmb::permutation(n, seed)); }, py::arg("n"),
      py::arg("seed"), "A seeded permutation identical on every platform.");

  // --- partition and allocation ----------------------------------------------------------------
  m.def(
      "partition_dp",
      [](const F64& fwd, const F64& act, Index stages, double comm_weight) {
        need_1d(fwd, "fwd");
        need_1d(act, "act");
        if (act.shape(0) != fwd.shape(0)) throw std::invalid_argument("activations need one entry per layer");
        if (stages < 1 || stages > fwd.shape(0)) throw std::invalid_argument("stages out of range");
        py::gil_scoped_release nogil;
        auto b = mmb::partition_dp(fwd.data(), act.data(), fwd.shape(0), stages, comm_weight);
        py::gil_scoped_acquire gil;
        return to_i64(b);
      },
      py::arg("fwd"), py::arg("act"), py::arg("stages"), py::arg("comm_weight"));
  m.def(
      "partition_greedy",
      [](const F64& fwd, Index stages) {
        need_1d(fwd, "fwd");
        if (stages < 1 || stages > fwd.shape(0)) throw std::invalid_argument("stages out of range");
        return to_i64(mmb::partition_greedy(fwd.data(), fwd.shape(0), stages));
      },
      py::arg("fwd"), py::arg("stages"));
  m.def(
      "partition_minmax",
      [](const F64& fwd, Index stages) {
        need_1d(fwd, "fwd");
        if (stages < 1 || stages > fwd.shape(0)) throw std::invalid_argument("stages out of range");
        return to_i64(mmb::partition_minmax(fwd.data(), fwd.shape(0), stages));
      },
      py::arg("fwd"), py::arg("stages"));

  m.def(
      "allocate",
      [](const F64& times, const F64& params, const F64& optim, const F64& act, const I64& max_pp, Index llm,
         const I64& tp_options, Index batch, Index num_gpus, double capacity, Index top_k, bool relaxed) {
        if (times.ndim() != 2 || times.shape(1) != tp_options.shape(0))
          throw std::invalid_argument("times must be [modules, len(tp_options)]");
        const Index M = times.shape(0);
        for (const py::array* a : {static_cast<const py::array*>(&params), static_cast<const py::array*>(&optim),
                                   static_cast<const py::array*>(&act), static_cast<const py::array*>(&max_pp)})
          if (a->ndim() != 1 || a->shape(0) != M)
            throw std::invalid_argument("module arrays need one entry per module");
        if (llm < 0 || llm >= M || batch < 1 || num_gpus < 1) throw std::invalid_argument("bad llm/batch/num_gpus");
        std::vector<ModuleSpec> mods(M);
        for (Index k = 0; k < M; ++k) {
          mods[k].time.assign(times.data() + k * times.shape(1), times.data() + (k + 1) * times.shape(1));
          mods[k].params = params.data()[k];
          mods[k].optimizer = optim.data()[k];
          mods[k].activation = act.data()[k];
          mods[k].max_pp = max_pp.data()[k];
        }
        std::vector<Index> tps(tp_options.data(), tp_options.data() + tp_options.shape(0));
        std::vector<AllocChoice> res;
        {
          py::gil_scoped_release nogil;
          res = mmb::allocate(mods, llm, tps, batch, num_gpus, capacity, top_k, relaxed);
        }
        py::list out;
        for (const auto& c : res) {
          py::dict d;
          d["tp"] = c.tp;
          d["dp"] = c.dp;
          d["pp"] = c.pp;
          d["iter_time"] = c.iter_time;
          d["warmup"] = c.warmup;
          d["steady"] = c.steady;
          d["gpus"] = c.gpus;
          out.append(d);
        }
        return out;
      },
      py::arg("times"), py::arg("params"), py::arg("optimizer"), py::arg("activation"), py::arg("max_pp"),
      py::arg("llm"),
      py::arg("tp_options"), py::arg("batch"), py::arg("num_gpus"), py::arg("capacity"), py::arg("top_k"),
      py::arg("relaxed") = false);
}

}  // namespace mmb
