// Step plans with gradient accumulation (accum.hpp).
#include "accum.hpp"

#include <algorithm>
#include <cmath>
#include <queue>
#include <stdexcept>
#include <tuple>
#include <vector>

#include "additive.hpp"
#include "bisect.hpp"
#include "helper_thread.hpp"

namespace mmb {

namespace {

constexpr Index kTwoThreadsFrom = 1 << 17;  // examples of an epoch from which two threads plan it

// One planner per thread: per-step buffers are reused from step to step.
class StepPlanner {
 public:
  StepPlanner(Index n, Index d, Index g, const CostModel& cm, bool padded)
      : n_(n), d_(d), g_(g), cm_(cm), padded_(padded), bins_(d * g) {}

  void plan(const int64_t* len, Index* rank, Index* micro, double* costs) {
    len_ = len;
    order_.resize(n_);
    for (Index i = 0; i < n_; ++i) order_[i] = i;
    std::sort(order_.begin(), order_.end(),
              [&](Index a, Index b) { return len[a] > len[b] || (len[a] == len[b] && a < b); });
    val_.resize(n_);
    for (Index i = 0; i < n_; ++i) val_[i] = padded_ ? head(len[i]) : item_weight(len[i], cm_);
    bin_.assign(n_, 0);
    slot_of_bin_.assign(bins_, 0);
    rank_of_bin_.assign(bins_, 0);
    bin_cost_.assign(bins_, 0.0);
    rem_.assign(order_.begin(), order_.end());
    for (Index k = 0; k < g_ && !rem_.empty(); ++k) {
      const Index m = g_ - k;
      const Index nrem = static_cast<Index>(rem_.size());
      const Index first_bin = k * d_;
      for (Index j = first_bin; j < first_bin + d_; ++j) slot_of_bin_[j] = k;
      bool dominant = false;
      double level = 0.0;
      if (m > 1 && nrem >= d_ * m) {
        const double top = val_[rem_[0]];
        if (padded_) {
          level = minmax_runs(d_ * m);
          dominant = level <= top * (1.0 + 1e-12);
          level = top;
        } else {
          double total = 0.0;
          for (Index i : rem_) total += val_[i];
          dominant = top > total / static_cast<double>(d_ * m) * (1.0 + 1e-12);
          level = top;
        }
      }
      if (!dominant) {
        final_split(first_bin, m);
        break;
      }
      if (padded_)
        fill_padded(first_bin, level, m);
      else
        fill_packed(first_bin, level, m);
    }
    assign_ranks();
    // per-micro-batch costs from sums, in one fixed order
    sum_.assign(bins_, 0.0);
    sq_.assign(bins_, 0.0);
    cnt_.assign(bins_, 0.0);
    mx_.assign(bins_, 0.0);
    for (Index i = 0; i < n_; ++i) {
      const Index b = bin_[i];
      const double l = static_cast<double>(len[i]);
      sum_[b] += l, sq_[b] += l * l, cnt_[b] += 1.0, mx_[b] = std::max(mx_[b], l);
      rank[i] = rank_of_bin_[b];
      micro[i] = slot_of_bin_[b];
    }
    for (Index b = 0; b < bins_; ++b)
      costs[slot_of_bin_[b] * d_ + rank_of_bin_[b]] = batch_cost(cm_, sum_[b], sq_[b], cnt_[b], mx_[b]);
  }

 private:
  // Padded cost of one example of length l alone: h(l).
  double head(int64_t l) const { return run_cost(cm_, 0.0, 1.0, static_cast<double>(l)); }

  // Examples a padded run led by an example of cost h may hold under `bound` (at least 0).
  Index run_count(double h, double bound, Index avail) const {
    if (h <= 0.0) return avail;
    if (h > bound) return 0;
    return std::min<Index>(avail, static_cast<Index>(std::floor(bound / h)));
  }

  // Least bound under which the remaining examples (length order) split into at most `bins`
  // padded runs: the exact min-max (exchange argument of padded.cpp: greedy from the largest).
  double minmax_runs(Index bins) const {
    const Index nrem = static_cast<Index>(rem_.size());
    double lo = val_[rem_[0]];
    for (Index p = 0; p < nrem; ++p)
      lo = std::max(lo, val_[rem_[p]] * static_cast<double>((p + bins) / bins));
    const double hi = std::max(lo, val_[rem_[0]] * static_cast<double>((nrem + bins - 1) / bins));
    if (lo <= 0.0) return 0.0;
    auto fits = [&](double bound) {
      Index runs = 0, p = 0;
      while (p < nrem) {
        if (runs == bins) return false;
        const Index c = run_count(val_[rem_[p]], bound, nrem - p);
        if (c < 1) return false;
        p += c;
        ++runs;
      }
      return true;
    };
    return least_feasible(lo, hi, fits, int64_t{1} << 28);
  }

  // Slot of bins first_bin..first_bin+d-1, additive cost: the remaining examples (descending) go
  // to the least loaded micro-batch of the slot while they fit under `level`; at least d * (m - 1)
  // stay for the later slots.
  void fill_packed(Index first_bin, double level, Index m) {
    using Key = std::tuple<double, Index, Index>;  // (load, count, bin): empty bins first
    std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap;
    for (Index j = 0; j < d_; ++j) heap.push({0.0, 0, first_bin + j});
    const Index nrem = static_cast<Index>(rem_.size());
    const Index can_take = nrem - d_ * (m - 1);
    const double smallest = val_[rem_.back()];
    Index taken = 0;
    keep_.clear();
    for (Index p = 0; p < nrem; ++p) {
      const Index i = rem_[p];
      auto [load, count, b] = heap.top();
      if (taken < can_take && load + val_[i] <= level * (1.0 + 1e-12)) {
        heap.pop();
        bin_[i] = b;
        heap.push({load + val_[i], count + 1, b});
        ++taken;
        continue;
      }
      keep_.push_back(i);
      if (taken >= can_take || load + smallest > level * (1.0 + 1e-12)) {  // nothing more fits
        keep_.insert(keep_.end(), rem_.begin() + p + 1, rem_.end());
        break;
      }
    }
    while (!heap.empty()) {
      bin_cost_[std::get<2>(heap.top())] = std::get<0>(heap.top());
      heap.pop();
    }
    rem_.swap(keep_);
  }

  // Slot of bins first_bin.., padded cost: d runs of the length order from the longest remaining
  // example, each as long as it stays under `level` (and leaves one example for every later bin).
  void fill_padded(Index first_bin, double level, Index m) {
    const Index nrem = static_cast<Index>(rem_.size());
    Index p = 0;
    for (Index j = 0; j < d_ && p < nrem; ++j) {
      const Index avail = nrem - p - d_ * (m - 1) - (d_ - 1 - j);
      const Index c = std::max<Index>(1, run_count(val_[rem_[p]], level * (1.0 + 1e-12), avail));
      for (Index q = p; q < p + c; ++q) bin_[rem_[q]] = first_bin + j;
      bin_cost_[first_bin + j] = static_cast<double>(c) * val_[rem_[p]];
      p += c;
    }
    rem_.erase(rem_.begin(), rem_.begin() + p);
  }

  // The remaining examples into d * m micro-batches of even cost (slots first_slot..g-1), grouped
  // by cost: the d costliest form the first of these slots, and so on.
  void final_split(Index first_bin, Index m) {
    const Index nb = d_ * m;
    const Index nrem = static_cast<Index>(rem_.size());
    local_.assign(nrem, 0);
    std::vector<double> load(nb, 0.0);
    if (padded_) {
      // min-max runs, then the costliest splittable runs halved until every bin has one
      const double bound = nrem ? minmax_runs(nb) : 0.0;
      struct Run {
        Index start, count;
      };
      std::vector<Run> runs;
      for (Index p = 0; p < nrem;) {
        const Index c = std::max<Index>(1, run_count(val_[rem_[p]], bound * (1.0 + 1e-12), nrem - p));
        runs.push_back({p, c});
        p += c;
      }
      auto cost_of = [&](const Run& r) { return static_cast<double>(r.count) * val_[rem_[r.start]]; };
      using Key = std::tuple<double, Index, Index>;  // (cost, -start, run)
      std::priority_queue<Key> heap;
      for (Index r = 0; r < static_cast<Index>(runs.size()); ++r)
        if (runs[r].count > 1) heap.push({cost_of(runs[r]), -runs[r].start, r});
      while (static_cast<Index>(runs.size()) < nb && !heap.empty()) {
        const Index r = std::get<2>(heap.top());
        heap.pop();
        const Index half = runs[r].count / 2;
        Run tail{runs[r].start + runs[r].count - half, half};
        runs[r].count -= half;
        runs.push_back(tail);
        for (Index q : {r, static_cast<Index>(runs.size()) - 1})
          if (runs[q].count > 1) heap.push({cost_of(runs[q]), -runs[q].start, q});
      }
      for (Index r = 0; r < static_cast<Index>(runs.size()); ++r) {
        for (Index q = runs[r].start; q < runs[r].start + runs[r].count; ++q) local_[q] = r;
        load[r] = cost_of(runs[r]);
      }
    } else {
      using Key = std::tuple<double, Index, Index>;  // (load, count, bin): empty bins first
      std::priority_queue<Key, std::vector<Key>, std::greater<Key>> heap;
      std::vector<Index> count(nb, 0);
      for (Index b = 0; b < nb; ++b) heap.push({0.0, 0, b});
      wl_.resize(nrem);
      for (Index p = 0; p < nrem; ++p) {
        wl_[p] = val_[rem_[p]];
        auto [l, c, b] = heap.top();
        heap.pop();
        local_[p] = b;
        heap.push({l + wl_[p], c + 1, b});
      }
      refine_additive(wl_.data(), nrem, nb, local_, std::min<Index>(4 * nb + 64, 2048));
      for (Index p = 0; p < nrem; ++p) load[local_[p]] += wl_[p];
    }
    // bins by cost, descending (ties by index): the j-th goes to slot first_slot + j / d
    std::vector<Index> by_cost(nb);
    for (Index b = 0; b < nb; ++b) by_cost[b] = b;
    std::stable_sort(by_cost.begin(), by_cost.end(), [&](Index a, Index b) { return load[a] > load[b]; });
    std::vector<Index> target(nb);
    for (Index j = 0; j < nb; ++j) {
      target[by_cost[j]] = first_bin + j;
      slot_of_bin_[first_bin + j] = first_bin / d_ + j / d_;
      bin_cost_[first_bin + j] = load[by_cost[j]];
    }
    for (Index p = 0; p < nrem; ++p) bin_[rem_[p]] = target[local_[p]];
    rem_.clear();
  }

  // Within every slot, its costliest micro-batch to the rank with the least total so far.
  void assign_ranks() {
    std::vector<double> total(d_, 0.0);
    std::vector<Index> ranks(d_), bins(d_);
    for (Index k = 0; k < g_; ++k) {
      for (Index r = 0; r < d_; ++r) ranks[r] = r, bins[r] = k * d_ + r;
      std::stable_sort(ranks.begin(), ranks.end(), [&](Index a, Index b) { return total[a] < total[b]; });
      std::stable_sort(bins.begin(), bins.end(), [&](Index a, Index b) { return bin_cost_[a] > bin_cost_[b]; });
      for (Index j = 0; j < d_; ++j) {
        rank_of_bin_[bins[j]] = ranks[j];
        total[ranks[j]] += bin_cost_[bins[j]];
      }
    }
  }

  const Index n_, d_, g_;
  const CostModel cm_;
  const bool padded_;
  const Index bins_;
  const int64_t* len_ = nullptr;
  std::vector<Index> order_, bin_, slot_of_bin_, rank_of_bin_, rem_, keep_, local_;
  std::vector<double> val_, bin_cost_, sum_, sq_, cnt_, mx_, wl_;
};

}  // namespace

void plan_accum(const int64_t* lengths, Index steps, Index n, Index d, Index g, const CostModel& cm, bool padded,
                Index* rank, Index* micro, double* costs) {
  if (d < 1 || g < 1 || n < 0 || steps < 0) throw std::invalid_argument("plan_accum: bad sizes");
  const bool padded_policy = cm.policy == Policy::Padded || cm.policy == Policy::PaddedQuadratic;
  if (padded != padded_policy) throw std::invalid_argument("plan_accum: policy does not match padded");
  auto run = [&](Index from, Index to) {
    StepPlanner planner(n, d, g, cm, padded);
    for (Index s = from; s < to; ++s)
      planner.plan(lengths + s * n, rank + s * n, micro + s * n, costs + s * g * d);
  };
  if (steps >= 2 && steps * n >= kTwoThreadsFrom) {
    const Index mid = steps / 2;
    run_beside([&] { run(mid, steps); }, [&] { run(0, mid); });
  } else {
    run(0, steps);
  }
}

}  // namespace mmb
