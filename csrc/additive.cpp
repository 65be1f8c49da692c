// LPT, its local search and largest differencing (additive.hpp).
#include "additive.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <set>
#include <utility>

#include "load_heap.hpp"
#include "scratch.hpp"

namespace mmb {

std::vector<Index> lpt(const double* w, const std::vector<Index>& order, Index d) {
  const size_t m = order.size();
  // Gather the weights into visiting order first and scatter the ranks at the end, so the
  // dependent heap loop touches only sequential memory (the gathers and scatters are independent
  // of each other and overlap their cache misses). Scratch buffers are left uninitialized.
  double* ws = scratch<double, 2>(m);
  bool integral = d <= (1 << 16);
  double total = 0.0;
  for (size_t k = 0; k < m; ++k) {
    ws[k] = w[order[k]];
    integral = integral && ws[k] >= 0 && ws[k] == std::floor(ws[k]);
    total += ws[k];
  }
  int32_t* rs = scratch<int32_t, 3>(m);
  // Examples that weigh nothing (visited last, lengths descending) change no load: they all go
  // to the rank on top then, with no tree walk (a quarter of all examples and more in audio).
  size_t weighed = m;
  while (weighed > 0 && ws[weighed - 1] == 0.0) --weighed;
  if (integral && total < 1e13) {
    // Integral loads: (load << 16 | rank) orders exactly like (load, rank), so each tree level
    // is one integer compare and one conditional move.
    PackedLoadHeap heap(d);
    for (size_t k = 0; k < weighed; ++k) {
      rs[k] = static_cast<int32_t>(heap.top());
      heap.add_to_top(static_cast<uint64_t>(ws[k]));
    }
    std::fill(rs + weighed, rs + m, static_cast<int32_t>(heap.top()));
  } else {
    LoadHeap heap(d, std::vector<double>(d, 0.0));
    for (size_t k = 0; k < weighed; ++k) {
      rs[k] = static_cast<int32_t>(heap.top());
      heap.add_to_top(ws[k]);
    }
    std::fill(rs + weighed, rs + m, static_cast<int32_t>(heap.top()));
  }
  std::vector<Index> dst(m);
  for (size_t k = 0; k < m; ++k) dst[order[k]] = rs[k];
  return dst;
}

void refine_additive(const double* w, Index n, Index d, std::vector<Index>& dst, Index max_iters) {
  if (d < 2 || n == 0) return;
  std::vector<double> load(d, 0.0);
  std::vector<Index> count(d, 0);
  // Nothing can beat max(largest item, total / d); with integral weights, its ceiling.
  double total = 0.0, wmax = 0.0;
  bool integral = true;
  for (Index i = 0; i < n; ++i) {
    load[dst[i]] += w[i];
    ++count[dst[i]];
    total += w[i];
    wmax = std::max(wmax, w[i]);
    integral = integral && w[i] == std::floor(w[i]);
  }
  const double avg = total / static_cast<double>(d);
  const double bound = std::max(wmax, integral ? std::ceil(avg) : avg);
  // Optimal, or within 0.02% of the proven bound: no makespan improvement worth a search is left
  // (this also keeps plans for thousands of ranks within a few milliseconds).
  if (*std::max_element(load.begin(), load.end()) <= bound * (1.0 + 2e-4)) return;
  // Examples by rank (CSR, one counting pass); a rank's own list is materialized only when the
  // search first touches it, so the setup stays O(n) with no allocation per rank.
  std::vector<Index> start(d + 1, 0), csr(n);
  for (Index r = 0; r < d; ++r) start[r + 1] = start[r] + count[r];
  {
    std::vector<Index> fill(start.begin(), start.end() - 1);
    for (Index i = 0; i < n; ++i) csr[fill[dst[i]]++] = i;
  }
  std::vector<std::vector<Index>> lists(d);
  std::vector<char> built(d, 0);
  auto items_of = [&](Index r) -> std::vector<Index>& {
    if (!built[r]) {
      lists[r].assign(csr.begin() + start[r], csr.begin() + start[r + 1]);
      built[r] = 1;
    }
    return lists[r];
  };
  // Ranks ordered by (load, rank): the extremes in O(1), updates in O(log d).
  std::set<std::pair<double, Index>> by_load;
  for (Index r = 0; r < d; ++r) by_load.insert({load[r], r});
  auto shift = [&](Index r, double delta) {
    by_load.erase({load[r], r});
    load[r] += delta;
    by_load.insert({load[r], r});
  };
  std::vector<Index> sorted_b;
  for (Index it = 0; it < max_iters; ++it) {
    // The most loaded rank with the lowest index among equals, and the least loaded one.
    const double top = by_load.rbegin()->first;
    const Index a = by_load.lower_bound({top, std::numeric_limits<Index>::min()})->second;
    const Index b = by_load.begin()->second;
    const double gap = load[a] - load[b];
    if (!(gap > 0) || load[a] <= bound) break;
    auto& items_a = items_of(a);
    auto& items_b = items_of(b);
    // Best single move a -> b: the weight closest to gap / 2 among those below gap.
    double best_max = load[a];
    Index best_x = -1, best_y = -1;
    for (Index x : items_a) {
      if (w[x] > 0 && w[x] < gap) {
        const double m = std::max(load[a] - w[x], load[b] + w[x]);
        if (m < best_max) best_max = m, best_x = x, best_y = -1;
      }
    }
    // Best swap x (on a) <-> y (on b): w_x - w_y in (0, gap), closest to gap / 2.
    sorted_b = items_b;
    std::sort(sorted_b.begin(), sorted_b.end(), [&](Index p, Index q) { return w[p] < w[q] || (w[p] == w[q] && p < q); });
    for (Index x : items_a) {
      const double target = w[x] - gap / 2;
      auto it2 = std::lower_bound(sorted_b.begin(), sorted_b.end(), target,
                                  [&](Index q, double t) { return w[q] < t; });
      for (int k = 0; k < 2; ++k) {
        auto cand = (k == 0) ? it2 : (it2 == sorted_b.begin() ? sorted_b.end() : it2 - 1);
        if (cand == sorted_b.end()) continue;
        const Index y = *cand;
        const double delta = w[x] - w[y];
        if (!(delta > 0 && delta < gap)) continue;
        const double m = std::max(load[a] - delta, load[b] + delta);
        if (m < best_max) best_max = m, best_x = x, best_y = y;
      }
    }
    if (best_x < 0) break;
    auto erase = [](std::vector<Index>& v, Index x) { v.erase(std::find(v.begin(), v.end(), x)); };
    erase(items_a, best_x);
    items_b.push_back(best_x);
    dst[best_x] = b;
    double delta = w[best_x];
    if (best_y >= 0) {
      erase(items_b, best_y);
      items_a.push_back(best_y);
      dst[best_y] = a;
      delta -= w[best_y];
    }
    shift(a, -delta);
    shift(b, delta);
  }
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

}  // namespace mmb
