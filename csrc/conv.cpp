// "conv" planning (conv.hpp): candidates, local search and the pick.
#include "conv.hpp"

#include <algorithm>
#include <cmath>
#include <exception>
#include <functional>
#include <future>
#include <limits>

#include "additive.hpp"
#include "bisect.hpp"
#include "helper_thread.hpp"
#include "load_heap.hpp"
#include "padded.hpp"
#include "scratch.hpp"

namespace mmb {

namespace {

constexpr Index kConvLargeItems = 100000, kConvThreadItems = 20000;

Index argmax(const std::vector<double>& v) {
  Index best = 0;
  for (Index i = 1; i < static_cast<Index>(v.size()); ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

struct RankState {
  std::vector<Index> items;  // sorted by length descending, ties by index
  double sum = 0.0;
};

}  // namespace

void refine_general(const int64_t* lengths, Index n, Index d, const CostModel& cm, std::vector<Index>& dst,
                    Index max_iters, const std::vector<Index>* order) {
  if (d < 2 || n == 0) return;
  auto before = [&](Index p, Index q) { return lengths[p] > lengths[q] || (lengths[p] == lengths[q] && p < q); };
  std::vector<Index> own;
  if (!order) order = &(own = order_by_length_desc(lengths, n));
  // Every rank's count, sum and largest length from one pass, its items (by length descending)
  // from a counting sort of the global order by rank; a rank's own list only when the search
  // first touches it: a few dozen steps touch a few hundred of thousands of ranks.
  Index* start = scratch<Index, 5>(static_cast<size_t>(d) + 1);
  Index* by_rank = scratch<Index, 6>(static_cast<size_t>(n));
  std::fill(start, start + d + 1, 0);
  std::vector<RankState> st(d);
  std::vector<int64_t> mx(d, 0);
  for (Index i = 0; i < n; ++i) {
    const Index r = dst[i];
    ++start[r + 1];
    st[r].sum += static_cast<double>(lengths[i]);
    mx[r] = std::max(mx[r], lengths[i]);
  }
  for (Index r = 0; r < d; ++r) start[r + 1] += start[r];
  {
    Index* fill = scratch<Index, 7>(static_cast<size_t>(d));
    std::copy(start, start + d, fill);
    for (Index i : *order) by_rank[fill[dst[i]]++] = i;
  }
  std::vector<char> built(d, 0);
  auto touch = [&](Index r) -> RankState& {
    if (!built[r]) st[r].items.assign(by_rank + start[r], by_rank + start[r + 1]), built[r] = 1;
    return st[r];
  };
  // first position after `pos` with a shorter item (items sorted by length descending)
  auto next_length = [&](const std::vector<Index>& items, size_t pos) {
    const int64_t l = lengths[items[pos]];
    if (pos + 1 >= items.size() || lengths[items[pos + 1]] != l) return pos + 1;
    return static_cast<size_t>(std::partition_point(items.begin() + static_cast<std::ptrdiff_t>(pos), items.end(),
                                                    [&](Index i) { return lengths[i] == l; }) -
                               items.begin());
  };
  auto cost_of = [&](const RankState& s) {
    if (s.items.empty()) return 0.0;
    return run_cost(cm, s.sum, static_cast<double>(s.items.size()), static_cast<double>(lengths[s.items[0]]));
  };
  std::vector<double> cost(d);
  for (Index r = 0; r < d; ++r) {
    const Index c = start[r + 1] - start[r];
    cost[r] = c == 0 ? 0.0 : run_cost(cm, st[r].sum, static_cast<double>(c), static_cast<double>(mx[r]));
  }
  constexpr Index kReceivers = 8;
  std::vector<Index> ranks(d);
  for (Index it = 0; it < max_iters; ++it) {
    const Index a = argmax(cost);
    const RankState& A = touch(a);
    if (A.items.empty()) break;
    for (Index r = 0; r < d; ++r) ranks[r] = r;
    const Index k = std::min<Index>(kReceivers, d - 1);
    std::nth_element(ranks.begin(), ranks.begin() + k, ranks.end(), [&](Index p, Index q) {
      return cost[p] < cost[q] || (cost[p] == cost[q] && p < q);
    });
    std::sort(ranks.begin(), ranks.begin() + k + 1,
              [&](Index p, Index q) { return cost[p] < cost[q] || (cost[p] == cost[q] && p < q); });
    const double ca = static_cast<double>(A.items.size());
    double best = cost[a];
    Index bx = -1, by = -1, bb = -1;
    for (Index j = 0; j <= k; ++j) {
      const Index b = ranks[j];
      if (b == a) continue;
      const RankState& B = touch(b);
      const double cb = static_cast<double>(B.items.size());
      const double mb = B.items.empty() ? 0.0 : static_cast<double>(lengths[B.items[0]]);
      // one item per distinct length: an item as long as the one before it gives the same moves
      // and swaps (never better); runs of equal lengths (zeros, fixed sizes) are skipped whole
      for (size_t xi = 0; xi < A.items.size(); xi = next_length(A.items, xi)) {
        const Index x = A.items[xi];
        const double lx = static_cast<double>(lengths[x]);
        // A without x: its max is the next item when x is the first.
        const double ma_wo = (xi == 0) ? (A.items.size() > 1 ? static_cast<double>(lengths[A.items[1]]) : 0.0)
                                       : static_cast<double>(lengths[A.items[0]]);
        const double new_a = (A.items.size() == 1) ? 0.0 : run_cost(cm, A.sum - lx, ca - 1, ma_wo);
        const double new_b = run_cost(cm, B.sum + lx, cb + 1, std::max(mb, lx));
        const double m = std::max(new_a, new_b);
        if (m < best) best = m, bx = x, by = -1, bb = b;
        // Swaps with every y on B (batches are small; bounded by kReceivers ranks).
        for (size_t yi = 0; yi < B.items.size(); yi = next_length(B.items, yi)) {
          const Index y = B.items[yi];
          const double ly = static_cast<double>(lengths[y]);
          if (ly == lx) continue;
          const double ma2 = std::max(ma_wo, ly);
          const double mb_wo = (yi == 0) ? (B.items.size() > 1 ? static_cast<double>(lengths[B.items[1]]) : 0.0) : mb;
          const double mb2 = std::max(mb_wo, lx);
          const double m2 = std::max(run_cost(cm, A.sum - lx + ly, ca, ma2), run_cost(cm, B.sum - ly + lx, cb, mb2));
          if (m2 < best) best = m2, bx = x, by = y, bb = b;
        }
      }
    }
    if (bx < 0) break;
    auto move = [&](Index x, Index from, Index to) {
      auto& f = st[from].items;
      f.erase(std::find(f.begin(), f.end(), x));
      auto& t = st[to].items;
      t.insert(std::lower_bound(t.begin(), t.end(), x, before), x);
      st[from].sum -= static_cast<double>(lengths[x]);
      st[to].sum += static_cast<double>(lengths[x]);
      dst[x] = to;
    };
    move(bx, a, bb);
    if (by >= 0) move(by, bb, a);
    cost[a] = cost_of(st[a]);
    cost[bb] = cost_of(st[bb]);
  }
}

std::vector<Index> paper_conv(const int64_t* lengths, Index n, Index d, const std::vector<Index>* sorted,
                              const std::vector<Index>* lpt_sums) {
  std::vector<Index> dst(n, 0);
  if (n == 0) return dst;
  std::vector<Index> own_order, own_base;
  if (!sorted) sorted = &(own_order = order_by_length_desc(lengths, n));
  const auto& order = *sorted;
  double* w = scratch<double, 10>(static_cast<size_t>(n));
  for (Index i = 0; i < n; ++i) w[i] = static_cast<double>(lengths[i]);
  if (!lpt_sums) lpt_sums = &(own_base = lpt(w, order, d));
  const double bound = max_cost(lengths, n, *lpt_sums, d, CostModel{Policy::Sum, 1.0, 0.0});
  std::vector<double> load(d, 0.0);
  Index g = 0, size = 0, pos = 0;
  for (; pos < n; ++pos) {
    const Index i = order[pos];
    if (static_cast<double>(size + 1) * static_cast<double>(lengths[i]) > bound) {
      if (g + 1 >= d) break;
      ++g, size = 0;
    }
    dst[i] = g;
    load[g] += w[i];
    ++size;
  }
  LoadHeap heap(d, load);
  for (; pos < n && w[order[pos]] > 0.0; ++pos) {
    const Index i = order[pos];
    dst[i] = heap.top();
    heap.add_to_top(w[i]);
  }
  for (; pos < n; ++pos) dst[order[pos]] = heap.top();  // weigh nothing: the loads stay (see lpt)
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

}  // namespace mmb
