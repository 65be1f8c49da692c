// Exact and near-exact plain planners for small and structured instances:
//   * "padded": exact (greedy from the largest + binary search), and the paper's algorithm 2;
//   * "padded" / "padded_quadratic": exact for any batch cost count * h(max) with h non-decreasing
//     (greedy from the largest under a bound + binary search on the bound);
//   * "conv": the optimal partition into runs of the length-sorted order (greedy longest run +
//     binary search), a strong start for local search;
//   * every policy: a budgeted branch and bound that looks for a strictly better plan than a
//     heuristic one; on the small instances where heuristics miss the optimum by percents (a few
//     dozen examples over a few ranks) it usually proves the optimum within its budget.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <exception>
#include <functional>
#include <future>
#include <limits>
#include <queue>

#include "balance.hpp"
#include "beside.hpp"
#include "scratch.hpp"

namespace mmb {

double batch_cost(const CostModel& cm, double sum, double sq, double count, double mx) {
  switch (cm.policy) {
    case Policy::Sum: return sum;
    case Policy::Padded: return count * mx;
    case Policy::Quadratic: return cm.alpha * sum + cm.beta * sq;
    case Policy::Conv: return cm.alpha * sum + cm.beta * count * mx * mx;
    case Policy::PaddedQuadratic: return cm.alpha * count * mx + cm.beta * count * mx * mx;
  }
  return 0.0;
}

namespace {

constexpr Index kConvLargeItems = 100000, kConvThreadItems = 20000;

int64_t bits_of(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

double double_of(int64_t b) {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// Smallest key in [lo, hi] with feasible(key), given feasible(hi) and a monotone predicate:
// galloping up from lo in steps of `step`, 2 step, 4 step ... (a lower bound is usually close to
// the optimum, so few probes are far from it), then bisection of the last gap.
template <class F>
int64_t least_feasible_key(int64_t lo, int64_t hi, int64_t step, F feasible, int64_t width = 0) {
  step = std::max<int64_t>(step, 1);
  while (lo < hi) {
    const int64_t probe = hi - lo > step ? lo + step : hi;
    if (feasible(probe)) {
      hi = probe;
      break;
    }
    lo = probe + 1;
    step = step > (std::numeric_limits<int64_t>::max() >> 2) ? step : 2 * step;
  }
  while (lo < hi && hi - lo > width) {  // `width`: stop once the gap is that narrow, at a feasible key
    const int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return hi;
}

// Smallest double B in [lo, hi] with feasible(B), given feasible(hi). Non-negative finite doubles
// are ordered like their bit patterns, so the search is exact; it starts at lo in relative steps
// of about 2^-10.
template <class F>
double least_feasible(double lo, double hi, F feasible, int64_t width = 0) {
  const int64_t key = least_feasible_key(
      bits_of(lo), bits_of(hi), int64_t{1} << 42, [&](int64_t k) { return feasible(double_of(k)); }, width);
  return double_of(key);
}

// Cost of a batch of `count` examples, the largest `mx` long and `sum` tokens in all.
double run_cost(const CostModel& cm, double sum, double count, double mx) {
  return batch_cost(cm, sum, 0.0, count, mx);
}

}  // namespace

namespace {

// Groups of a descending-sorted sequence `s` under padded bound B: each group starts at its largest
// item l and holds at most floor(B / l) items. Returns the number of groups (stops past `limit`).
Index greedy_groups_desc(const std::vector<int64_t>& s, int64_t bound, Index limit) {
  const Index n = static_cast<Index>(s.size());
  Index groups = 0, i = 0;
  while (i < n) {
    if (groups == limit) return limit + 1;
    const int64_t first = s[i];
    const Index cap = first == 0 ? n : static_cast<Index>(bound / first);
    if (cap < 1) return limit + 1;
    i = std::min(n, i + cap);
    ++groups;
  }
  return groups;
}

}  // namespace

std::vector<Index> padded_optimal(const int64_t* lengths, Index n, Index d) {
  std::vector<Index> dst(n, 0);
  if (n == 0) return dst;
  const auto order = order_by_length_desc(lengths, n);
  std::vector<int64_t> s(n);
  for (Index k = 0; k < n; ++k) s[k] = lengths[order[k]];
  // Exchange argument: for a bound B some optimal partition puts the largest item with the next
  // floor(B/l_max)-1 largest ones, recursively; so the greedy decides feasibility exactly and the
  // search finds the optimal min-max padded cost. It starts from the count bound (the k largest
  // put ceil(k/d) of them on one rank, each padded to at least the k-th largest).
  int64_t lo = s[0];
  for (Index k = 0; k < n; ++k) lo = std::max(lo, s[k] * ((k + d) / d));
  const int64_t hi = std::max(lo, s[0] * ((n + d - 1) / d));
  const int64_t best =
      least_feasible_key(lo, hi, lo >> 10, [&](int64_t b) { return greedy_groups_desc(s, b, d) <= d; });
  Index g = 0, i = 0;
  while (i < n) {
    const Index cap = s[i] == 0 ? n : static_cast<Index>(best / s[i]);
    const Index end = std::min(n, i + cap);
    for (Index j = i; j < end; ++j) dst[order[j]] = g;
    i = end;
    ++g;
  }
  return dst;
}

std::vector<Index> paper_padded(const int64_t* lengths, Index n, Index d) {
  std::vector<Index> dst(n, 0);
  if (n == 0) return dst;
  auto order = order_by_length_desc(lengths, n);
  std::reverse(order.begin(), order.end());  // ascending
  auto groups_for = [&](int64_t b, std::vector<Index>* out) {
    Index g = 0, size = 0;
    for (Index i : order) {
      if (size > 0 && (size + 1) * lengths[i] > b) ++g, size = 0;
      if (out) (*out)[i] = g;
      ++size;
    }
    return g + 1;
  };
  int64_t left = lengths[order[0]];
  int64_t right = std::max<int64_t>(lengths[order.back()] * (n / d + 1), left);
  while (left < right) {
    const int64_t mid = left + (right - left) / 2;
    if (groups_for(mid, nullptr) <= d)
      right = mid;
    else
      left = mid + 1;
  }
  groups_for(left, &dst);
  // The paper's search range can end infeasible when items are all zero; clamp like the paper
  // implicitly does by merging overflow groups into the last rank.
  for (auto& r : dst) r = std::min(r, d - 1);
  return dst;
}

std::vector<Index> padded_general_optimal(const int64_t* lengths, Index n, Index d, const CostModel& cm) {
  std::vector<Index> dst(n, 0);
  if (n == 0) return dst;
  const auto order = order_by_length_desc(lengths, n);
  std::vector<double> s(n);
  for (Index k = 0; k < n; ++k) s[k] = static_cast<double>(lengths[order[k]]);
  // For a bound B the batch holding the largest example may hold at most the c examples with
  // count * h(l_max) <= B; giving it the next c - 1 largest lowers every other batch's maximum, so
  // the greedy from the largest decides feasibility exactly (the exchange argument of the padded
  // case holds for any non-decreasing h).
  auto groups = [&](double bound, Index limit, std::vector<Index>* out) {
    Index g = 0, i = 0;
    while (i < n) {
      if (g == limit) return limit + 1;
      const double m = s[i];
      const double one = run_cost(cm, 0.0, 1.0, m);
      if (one > bound) return limit + 1;
      // the largest count c with cost(c) <= bound: from the quotient, then exact steps
      Index c = one > 0.0 ? static_cast<Index>(std::min<double>(static_cast<double>(n), std::floor(bound / one))) : n;
      c = std::max<Index>(c, 1);
      while (c > 1 && run_cost(cm, 0.0, static_cast<double>(c), m) > bound) --c;
      while (c < n && run_cost(cm, 0.0, static_cast<double>(c + 1), m) <= bound) ++c;
      const Index end = std::min(n, i + c);
      if (out)
        for (Index j = i; j < end; ++j) (*out)[order[j]] = g;
      i = end;
      ++g;
    }
    return g;
  };
  // from the count bound: the k largest put ceil(k/d) of them on one rank, whose maximum is at
  // least the k-th largest
  double lo = run_cost(cm, 0.0, 1.0, s[0]);
  for (Index k = 0; k < n; ++k) lo = std::max(lo, run_cost(cm, 0.0, static_cast<double>((k + d) / d), s[k]));
  const double hi = run_cost(cm, 0.0, static_cast<double>((n + d - 1) / d), s[0]);
  const double best = least_feasible(lo, std::max(lo, hi), [&](double b) { return groups(b, d, nullptr) <= d; });
  groups(best, d, &dst);
  return dst;
}

double refine_floor(const int64_t* lengths, Index n, Index d, const CostModel& cm, const std::vector<Index>& dst,
                    Index iters) {
  // batch_costs gives the cost refine_general's result is judged by (max_cost); an unchanged rank
  // gets the same number from it: its sums run over the same examples in the same order
  const Index keep = 2 * iters + 1;
  if (keep > d) return -std::numeric_limits<double>::infinity();
  auto c = batch_costs(lengths, n, dst.data(), d, cm);
  std::nth_element(c.begin(), c.begin() + (keep - 1), c.end(), std::greater<double>());
  return c[keep - 1];
}

std::vector<Index> balance_conv(const int64_t* lengths, Index n, Index d, const CostModel& cm, Index iters) {
  // Candidates: the paper's algorithm 5, LPT, the padded optimum and the best partition into
  // runs of the sorted order; each refined by local search on the true cost.
  // At scale (hundreds of thousands of examples) the padded optimum, itself a partition into
  // runs, is never better than the best runs before the local search, nor seen better after.
  // The refined runs are the reference: another candidate is refined only when the search could
  // reach a cost that wins against them (see refine_floor); the others cannot be picked.
  // The candidates are independent: large problems build and refine them on two threads
  // (one builds LPT and the paper's from it and refines the paper's; the other builds the runs
  // and the padded optimum and refines them and LPT); the choice below does not depend on
  // which finishes first.
  const bool large = n >= kConvLargeItems;
  const auto order = order_by_length_desc(lengths, n);
  std::vector<std::vector<Index>> cands(large ? 3 : 4);
  std::vector<double> cost(cands.size(), std::numeric_limits<double>::infinity());
  auto finish = [&](size_t k) {
    refine_general(lengths, n, d, cm, cands[k], iters, &order);
    cost[k] = max_cost(lengths, n, cands[k], d, cm);
  };
  // refines candidate k unless it cannot beat the refined runs (`first`: k is picked before the
  // runs on a tie)
  auto finish_unless_beaten = [&](size_t k, double runs, bool first) {
    const double floor = refine_floor(lengths, n, d, cm, cands[k], iters);
    if (first ? floor > runs : floor >= runs) return;
    finish(k);
  };
  std::promise<void> lpt_built;
  std::promise<double> runs_refined;
  auto lpt_ready = lpt_built.get_future();
  auto runs_ready = runs_refined.get_future();
  auto lpt_and_paper = [&] {
    double* s = scratch<double, 11>(static_cast<size_t>(n));
    for (Index i = 0; i < n; ++i) s[i] = static_cast<double>(lengths[i]);
    cands[0] = lpt(s, order, d);
    cands[1] = paper_conv(lengths, n, d, &order, &cands[0]);  // before LPT is refined
    lpt_built.set_value();
  };
  auto refine_paper = [&] { finish_unless_beaten(1, runs_ready.get(), true); };  // get: rethrows
  auto runs_padded_and_lpt = [&] {
    cands[2] = conv_runs(lengths, n, d, cm, &order);
    finish(2);
    runs_refined.set_value(cost[2]);
    if (!large) cands[3] = padded_optimal(lengths, n, d), finish_unless_beaten(3, cost[2], false);
    lpt_ready.get();  // rethrows what stopped the other side (then nothing more is done here)
    finish_unless_beaten(0, cost[2], false);
  };
  if (n >= kConvThreadItems) {
    // a side that stops on an exception (out of memory) passes it on to what the other side
    // waits for; run_beside rethrows it
    run_beside(
        [&] {
          try {
            runs_padded_and_lpt();
          } catch (...) {
            try {
              runs_refined.set_exception(std::current_exception());
            } catch (...) {  // already set: the runs were refined
            }
            throw;
          }
        },
        [&] {
          try {
            lpt_and_paper();
          } catch (...) {
            lpt_built.set_exception(std::current_exception());
            throw;
          }
          refine_paper();
        });
  } else {
    lpt_and_paper();
    runs_padded_and_lpt();
    refine_paper();
  }
  // the first of the least costly (candidates in the order paper, runs, LPT, padded)
  const size_t order_of_pick[] = {1, 2, 0, 3};
  size_t pick = order_of_pick[0];
  for (size_t k : order_of_pick)
    if (k < cands.size() && cost[k] < cost[pick]) pick = k;
  std::vector<Index> best = std::move(cands[pick]);
  return best;
}

std::vector<Index> conv_runs(const int64_t* lengths, Index n, Index d, const CostModel& cm,
                             const std::vector<Index>* sorted) {
  std::vector<Index> dst(n, 0);
  if (n == 0) return dst;
  std::vector<Index> own;
  if (!sorted) sorted = &(own = order_by_length_desc(lengths, n));
  const auto& order = *sorted;
  // sorted lengths and their prefix sums (whole numbers below 2^53: exact)
  double* len = scratch<double, 8>(static_cast<size_t>(n));  // per-thread, reused
  double* pre = scratch<double, 9>(static_cast<size_t>(n) + 1);
  pre[0] = 0.0;
  double squares = 0.0;
  for (Index k = 0; k < n; ++k) {
    len[k] = static_cast<double>(lengths[order[k]]);
    pre[k + 1] = pre[k] + len[k];
    squares += len[k] * len[k];
  }
  auto cost = [&](Index i, Index j) {  // the run [i, j)
    return run_cost(cm, pre[j] - pre[i], static_cast<double>(j - i), len[i]);
  };
  // Greedy longest run from the largest is optimal among partitions into runs of the sorted
  // order: a run's cost only falls when its first (largest) example is dropped. A run's cost grows
  // with its end, so each run's end is found by galloping and bisection: O(d log n) per bound.
  // Neighbouring runs in the sorted order are about as long, so the search starts from the last
  // run's length: usually two costs decide the end.
  auto groups = [&](double bound, Index limit, std::vector<Index>* out) {
    Index g = 0, i = 0, guess = 1;
    while (i < n) {
      if (g == limit || cost(i, i + 1) > bound) return limit + 1;
      // cost(i, ok) <= bound < cost(i, bad); bad = n + 1 while no infeasible end is known
      Index ok = i + 1, bad = n + 1;
      const Index first = std::min(n, i + guess);
      if (first > ok) (cost(i, first) <= bound ? ok : bad) = first;
      if (bad > n) {
        for (Index step = 1; ok < n; step *= 2) {  // gallop up
          const Index probe = std::min(n, ok + step);
          if (cost(i, probe) > bound) {
            bad = probe;
            break;
          }
          ok = probe;
        }
      } else {
        for (Index step = 1; bad - ok > 1; step *= 2) {  // gallop down
          const Index probe = std::max(ok + 1, bad - step);
          if (cost(i, probe) <= bound) {
            ok = probe;
            break;
          }
          bad = probe;
        }
      }
      while (bad - ok > 1) {  // bisection of the gap left (bad <= n here)
        const Index mid = ok + (bad - ok) / 2;
        (cost(i, mid) <= bound ? ok : bad) = mid;
      }
      if (out)
        for (Index k = i; k < ok; ++k) (*out)[order[k]] = g;
      guess = ok - i;
      i = ok;
      ++g;
    }
    return g;
  };
  // every batch costs at least alpha * sum l + beta * sum l^2 (b * max^2 >= sum of squares)
  const double area = (cm.alpha * pre[n] + cm.beta * squares) / static_cast<double>(d);
  const double lo = std::max(cost(0, 1), area);
  const double hi = std::max(lo, cost(0, n));
  // within 2^-20 (relative) of the least feasible bound: a candidate, not an exact answer, and
  // 30 fewer feasibility passes than the exact search
  const double best =
      least_feasible(lo, hi, [&](double b) { return groups(b, d, nullptr) <= d; }, int64_t{1} << 32);
  groups(best, d, &dst);
  return dst;
}

std::vector<Index> largest_differencing(const double* w, Index n, Index d) {
  // Karmarkar-Karp for d ranks: every example starts as a d-tuple (w, 0, ..., 0); the two tuples
  // with the largest spread are merged largest part with smallest part, until one is left. Parts
  // are lists of examples (linked through `next`), so a merge moves no example.
  struct Part {
    double sum;
    Index head, tail;
  };
  std::vector<Index> next(n, -1), dst(n, 0);
  if (n == 0) return dst;
  std::vector<std::vector<Part>> tuples(n);
  using Key = std::pair<double, Index>;  // (spread, -id): the largest spread, then the oldest tuple
  std::priority_queue<Key> heap;
  for (Index i = 0; i < n; ++i) {
    tuples[i].assign(d, Part{0.0, -1, -1});
    tuples[i][0] = Part{w[i], i, i};
    heap.push({w[i], -i});
  }
  std::vector<Part> merged(d);
  while (heap.size() > 1) {
    const Index a = -heap.top().second;
    heap.pop();
    const Index b = -heap.top().second;
    heap.pop();
    auto& A = tuples[a];
    auto& B = tuples[b];
    for (Index r = 0; r < d; ++r) {
      const Part& x = A[r];
      const Part& y = B[d - 1 - r];
      Part z{x.sum + y.sum, x.head, x.tail};
      if (z.head < 0) {
        z.head = y.head, z.tail = y.tail;
      } else if (y.head >= 0) {
        next[z.tail] = y.head;
        z.tail = y.tail;
      }
      merged[r] = z;
    }
    std::stable_sort(merged.begin(), merged.end(), [](const Part& p, const Part& q) { return p.sum > q.sum; });
    const double low = merged[d - 1].sum;
    for (auto& p : merged) p.sum -= low;
    A.swap(merged);
    merged.assign(d, Part{0.0, -1, -1});
    std::vector<Part>().swap(B);
    heap.push({A[0].sum, -a});
  }
  const auto& last = tuples[-heap.top().second];
  for (Index r = 0; r < d; ++r)
    for (Index i = last[r].head; i >= 0; i = (i == last[r].tail) ? -1 : next[i]) dst[i] = r;
  return dst;
}

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
