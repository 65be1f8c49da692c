// The branch and bound of exact_search.hpp: decision probes "every batch costs at most C", each a
// depth-first search with best fit, symmetry cuts and a limited discrepancy budget.
#include "exact_search.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <utility>

namespace mmb {

namespace {

// Depth-first search over the examples in descending length order for a plan with every batch
// cost at most a cap. Each node puts the next example on one rank; ranks in the same state are
// tried once (they are interchangeable), fullest first (best fit), and a node is cut when the
// batches' total cost plus a lower bound on what the remaining examples add exceeds d caps.
class Search {
 public:
  enum Outcome { kFound, kInfeasible, kGaveUp };

  Search(const int64_t* lengths, Index n, Index d, const CostModel& cm)
      : len_(lengths), n_(n), d_(d), cm_(cm) {
    order_ = order_by_length_desc(lengths, n);
    rest_.assign(n + 1, 0.0);
    for (Index k = n - 1; k >= 0; --k) rest_[k] = rest_[k + 1] + least_increase(lengths[order_[k]]);
    cand_.assign(static_cast<size_t>(n) * d, {0.0, 0});
  }

  // Every policy's batch cost grows by at least this when an example of length l joins it.
  double least_increase(int64_t length) const {
    const double l = static_cast<double>(length);
    return (cm_.policy == Policy::Sum || cm_.policy == Policy::Padded) ? l : cm_.alpha * l + cm_.beta * l * l;
  }

  // Both orders of trying ranks, each with half the budget: best fit (fullest rank first) packs
  // tight caps, worst fit (emptiest first) spreads many similar examples evenly.
  Outcome probe(double cap, int64_t budget, std::vector<Index>& dst) {
    const Outcome first = probe_one(cap, budget / 2, false, dst);
    if (first != kGaveUp) return first;
    return probe_one(cap, budget - budget / 2, true, dst);
  }

  Outcome probe_one(double cap, int64_t budget, bool worst_fit, std::vector<Index>& dst) {
    cap_ = cap, nodes_ = 0, budget_ = budget, worst_fit_ = worst_fit;
    sum_.assign(d_, 0.0), sq_.assign(d_, 0.0), cost_.assign(d_, 0.0);
    cnt_.assign(d_, 0), mx_.assign(d_, 0);
    cur_.assign(n_, 0);
    // Limited discrepancy search: first the plans that leave the preferred choice at few nodes, so
    // an early wrong choice cannot trap the whole budget in one subtree; the last round, with no
    // limit, is the complete search.
    for (int64_t limit : {int64_t{0}, int64_t{1}, int64_t{2}, int64_t{4}, int64_t{8}, kNoLimit}) {
      cut_ = false;
      if (dfs(0, 0.0, limit)) {
        for (Index k = 0; k < n_; ++k) dst[order_[k]] = cur_[k];
        return kFound;
      }
      if (nodes_ > budget_) return kGaveUp;
      if (!cut_) return kInfeasible;  // nothing was skipped: the search was complete
    }
    return kInfeasible;
  }

 private:
  static constexpr int64_t kNoLimit = std::numeric_limits<int64_t>::max();

  bool dfs(Index k, double total, int64_t discrepancies) {
    if (k == n_) return true;
    if (++nodes_ > budget_) return false;
    if ((total + rest_[k]) / static_cast<double>(d_) > cap_) return false;
    const int64_t li = len_[order_[k]];
    const double l = static_cast<double>(li);
    auto* cand = &cand_[static_cast<size_t>(k) * d_];
    Index m = 0;
    for (Index r = 0; r < d_; ++r) {
      bool twin = false;
      for (Index q = 0; q < r && !twin; ++q)
        twin = cnt_[q] == cnt_[r] && mx_[q] == mx_[r] && sum_[q] == sum_[r] && sq_[q] == sq_[r];
      if (twin) continue;
      const double c = batch_cost(cm_, sum_[r] + l, sq_[r] + l * l, static_cast<double>(cnt_[r] + 1),
                                  static_cast<double>(std::max(mx_[r], li)));
      if (c > cap_) continue;
      cand[m++] = {c, r};
    }
    std::sort(cand, cand + m, [&](const auto& a, const auto& b) {
      if (a.first != b.first) return worst_fit_ ? a.first < b.first : a.first > b.first;
      return a.second < b.second;
    });
    for (Index j = 0; j < m; ++j) {
      if (j > discrepancies) {
        cut_ = true;
        break;
      }
      const Index r = cand[j].second;
      const double s0 = sum_[r], q0 = sq_[r], c0 = cost_[r];
      const int64_t m0 = mx_[r];
      const double c = cand[j].first;
      sum_[r] += l, sq_[r] += l * l, cnt_[r] += 1, mx_[r] = std::max(m0, li), cost_[r] = c;
      cur_[k] = r;
      if (dfs(k + 1, total - c0 + c, discrepancies == kNoLimit ? kNoLimit : discrepancies - j)) return true;
      sum_[r] = s0, sq_[r] = q0, cnt_[r] -= 1, mx_[r] = m0, cost_[r] = c0;
      if (nodes_ > budget_) return false;
    }
    return false;
  }

  const int64_t* len_;
  Index n_, d_;
  CostModel cm_;
  double cap_ = 0.0;
  int64_t budget_ = 0, nodes_ = 0;
  bool cut_ = false, worst_fit_ = false;
  std::vector<Index> order_, cur_;
  std::vector<double> rest_, sum_, sq_, cost_;
  std::vector<int64_t> cnt_, mx_;
  std::vector<std::pair<double, Index>> cand_;
};

}  // namespace

bool improve_small(const int64_t* lengths, Index n, Index d, const CostModel& cm, std::vector<Index>& dst,
                   int64_t budget) {
  if (n == 0 || d < 2) return false;
  double hi = max_cost(lengths, n, dst, d, cm);
  // A lower bound: the largest single example, or the average of the least cost increases.
  Search search(lengths, n, d, cm);
  double single = 0.0, area = 0.0;
  for (Index i = 0; i < n; ++i) {
    const double l = static_cast<double>(lengths[i]);
    single = std::max(single, batch_cost(cm, l, l * l, 1.0, l));
    area += search.least_increase(lengths[i]);
  }
  double lo = std::max(single, area / static_cast<double>(d));
  if (hi <= lo) return false;
  // Whole-number costs ("sum", "padded", integral coefficients) allow whole-number probes.
  bool integral = true;
  for (Index i = 0; i < n && integral; ++i) {
    const double l = static_cast<double>(lengths[i]);
    integral = batch_cost(cm, l, l * l, 1.0, l) == std::floor(batch_cost(cm, l, l * l, 1.0, l)) &&
               search.least_increase(lengths[i]) == std::floor(search.least_increase(lengths[i]));
  }
  if (integral && cm.policy != Policy::Sum && cm.policy != Policy::Padded) integral = cm.alpha == std::floor(cm.alpha) && cm.beta == std::floor(cm.beta);
  if (integral) lo = std::ceil(lo);
  // Decision probes "every batch costs at most C": at the lower bound, then bisection between the
  // best proven-infeasible cap and the best plan found; a probe that runs out of nodes counts as
  // infeasible (the search only ever returns a plan it found).
  bool improved = false;
  std::vector<Index> cand(dst);
  const int64_t per_probe = std::max<int64_t>(budget / 8, 1);
  int64_t left = budget;
  bool first = true;
  while (left > 0 && lo < hi) {
    double cap = first ? lo : lo + 0.5 * (hi - lo);
    if (integral) cap = std::floor(cap);
    if (!(cap < hi) || cap < lo) break;
    first = false;
    const auto outcome = search.probe(cap, std::min(per_probe, left), cand);
    left -= per_probe;
    if (outcome == Search::kFound) {
      const double got = max_cost(lengths, n, cand, d, cm);
      if (got < hi) {
        hi = got;
        dst = cand;
        improved = true;
      } else {
        break;  // rounding: the plan is no better when costed the usual way
      }
    } else {
      lo = integral ? cap + 1.0 : std::nextafter(cap, std::numeric_limits<double>::infinity());
      if (!integral && hi - lo <= 1e-9 * hi) break;
    }
  }
  return improved;
}

}  // namespace mmb
