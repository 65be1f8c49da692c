// Plain post-balancing: LPT (OrchMLLM alg. 1) with local search, the exact padded partition
// (better than alg. 2), quadratic (better than alg. 4) and conv (better than alg. 5).
#include "balance.hpp"
#include "beside.hpp"
#include "radix.hpp"
#include "scratch.hpp"

#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <set>
#include <stdexcept>

namespace mmb {

namespace {

// Tournament (winner) tree over the ranks, keyed by (load, rank): the root holds the least loaded
// rank, and adding load to it replays one leaf-to-root path with one comparison per level. Loads
// and ranks live in two arrays indexed by tree node and each level picks a child by index
// arithmetic (no branch to mispredict), so an LPT step is log2(d) short steps.
class LoadHeap {
 public:
  LoadHeap(Index d, const std::vector<double>& load) {
    size_ = 1;
    while (size_ < d) size_ <<= 1;
    key_.assign(2 * size_, std::numeric_limits<double>::infinity());
    who_.assign(2 * size_, 0);
    for (Index i = 0; i < size_; ++i) {
      key_[size_ + i] = i < d ? load[i] : std::numeric_limits<double>::infinity();
      who_[size_ + i] = static_cast<int32_t>(i);
    }
    for (Index v = size_ - 1; v >= 1; --v) pull(v);
  }
  Index top() const { return who_[1]; }
  // Add `w` to the load of the top rank and restore the tree. The running winner stays in
  // registers on the way up and only the siblings are loaded: their addresses are known in
  // advance and none of them was just stored, so the loads issue in parallel and the dependent
  // chain per level is one compare and two selects.
  void add_to_top(double w) {
    Index v = size_ + who_[1];
    double ck = key_[v] + w;
    int32_t cw = who_[v];
    key_[v] = ck;
    for (; v > 1; v >>= 1) {
      const Index sib = v ^ 1;
      const double sk = key_[sib];
      // the left child holds the lower ranks and wins ties
      const bool take = (sk < ck) | (static_cast<bool>(v & 1) & (sk == ck));
      const int32_t sw = who_[sib];
      ck = take ? sk : ck;
      cw = take ? sw : cw;
      key_[v >> 1] = ck;
      who_[v >> 1] = cw;
    }
  }

 private:
  // The left child holds the lower ranks, so on equal loads the left (lower rank) wins.
  void pull(Index v) {
    const Index c = 2 * v + static_cast<Index>(key_[2 * v + 1] < key_[2 * v]);
    key_[v] = key_[c];
    who_[v] = who_[c];
  }
  Index size_ = 1;
  std::vector<double> key_;
  std::vector<int32_t> who_;
};

// The tournament tree for integral loads of at most 2^16 ranks: a node is the single word
// (load << 16 | rank), which orders exactly like (load, rank).
class PackedLoadHeap {
 public:
  explicit PackedLoadHeap(Index d) {
    size_ = 1;
    while (size_ < d) size_ <<= 1;
    node_.assign(2 * size_, ~uint64_t{0});
    for (Index i = 0; i < d; ++i) node_[size_ + i] = static_cast<uint64_t>(i);
    for (Index v = size_ - 1; v >= 1; --v) node_[v] = std::min(node_[2 * v], node_[2 * v + 1]);
  }
  Index top() const { return static_cast<Index>(node_[1] & 0xffff); }
  void add_to_top(uint64_t w) {
    Index v = size_ + top();
    uint64_t cur = node_[v] + (w << 16);
    node_[v] = cur;
    for (; v > 1; v >>= 1) {
      cur = std::min(cur, node_[v ^ 1]);
      node_[v >> 1] = cur;
    }
  }

 private:
  Index size_ = 1;
  std::vector<uint64_t> node_;
};

Index argmax(const std::vector<double>& v) {
  Index best = 0;
  for (Index i = 1; i < static_cast<Index>(v.size()); ++i)
    if (v[i] > v[best]) best = i;
  return best;
}

}  // namespace

std::vector<Index> order_by_length_desc(const int64_t* lengths, Index n) {
  std::vector<Index> order;
  order_by_length_desc(lengths, n, order);
  return order;
}

void order_by_length_desc(const int64_t* lengths, Index n, std::vector<Index>& order) {
  order.resize(n);
  if (n == 0) return;
  int64_t mx = 0;
  for (Index i = 0; i < n; ++i) mx = std::max(mx, lengths[i]);
  const uint64_t range = static_cast<uint64_t>(mx);
  if (range < (uint64_t{1} << 16) && range <= 4 * static_cast<uint64_t>(n)) {
    // few distinct values (token counts of one modality): one counting pass, stable (ties stay in
    // index order), on the key mx - l
    Index* start = scratch<Index, 3>(static_cast<size_t>(range) + 2);
    std::fill(start, start + range + 2, 0);
    for (Index i = 0; i < n; ++i) ++start[mx - lengths[i] + 1];
    for (uint64_t k = 1; k <= range; ++k) start[k] += start[k - 1];
    for (Index i = 0; i < n; ++i) order[start[mx - lengths[i]]++] = i;
    return;
  }
  // LSD radix sort on the key mx - l (ascending == lengths descending); stable, so ties stay in
  // index order. When key and index fit in 32 bits each they travel packed in one word, halving
  // the memory traffic of every pass.
  const int bits = bit_width(range);
  if (range < (1ull << 32) && static_cast<uint64_t>(n) < (1ull << 32)) {
    uint64_t* a = scratch<uint64_t, 0>(n);
    uint64_t* b = scratch<uint64_t, 1>(n);
    for (Index i = 0; i < n; ++i) a[i] = (static_cast<uint64_t>(mx - lengths[i]) << 32) | static_cast<uint64_t>(i);
    const uint64_t* sorted = radix_sort(a, b, static_cast<size_t>(n), bits, [](uint64_t e) { return e >> 32; });
    for (Index i = 0; i < n; ++i) order[i] = static_cast<Index>(sorted[i] & 0xffffffffu);
    return;
  }
  struct Keyed {
    uint64_t key;
    Index idx;
  };
  std::vector<Keyed> a(n), b(n);
  for (Index i = 0; i < n; ++i) a[i] = {static_cast<uint64_t>(mx - lengths[i]), i};
  const Keyed* sorted = radix_sort(a.data(), b.data(), static_cast<size_t>(n), bits, [](const Keyed& e) { return e.key; });
  for (Index i = 0; i < n; ++i) order[i] = sorted[i].idx;
}

double item_weight(int64_t length, const CostModel& cm) {
  const double l = static_cast<double>(length);
  if (cm.policy == Policy::Sum) return l;
  return cm.alpha * l + cm.beta * l * l;
}

std::vector<double> batch_costs(const int64_t* lengths, Index n, const Index* dst, Index d, const CostModel& cm) {
  std::vector<double> sum(d, 0.0), sq(d, 0.0);
  std::vector<int64_t> count(d, 0), mx(d, 0);
  for (Index i = 0; i < n; ++i) {
    const Index r = dst[i];
    const double l = static_cast<double>(lengths[i]);
    sum[r] += l;
    sq[r] += l * l;
    count[r] += 1;
    mx[r] = std::max(mx[r], lengths[i]);
  }
  std::vector<double> cost(d);
  for (Index r = 0; r < d; ++r) {
    const double m = static_cast<double>(mx[r]);
    const double b = static_cast<double>(count[r]);
    cost[r] = batch_cost(cm, sum[r], sq[r], b, m);
  }
  return cost;
}

double max_cost(const int64_t* lengths, Index n, const std::vector<Index>& dst, Index d, const CostModel& cm) {
  const auto c = batch_costs(lengths, n, dst.data(), d, cm);
  return c.empty() ? 0.0 : *std::max_element(c.begin(), c.end());
}

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

namespace {

struct RankState {
  std::vector<Index> items;  // sorted by length descending, ties by index
  double sum = 0.0;
};

// Cost of a batch under a policy that ignores squared lengths ("conv" and the padded ones).
double conv_cost(const CostModel& cm, double sum, double count, double mx) { return batch_cost(cm, sum, 0.0, count, mx); }

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
    return conv_cost(cm, s.sum, static_cast<double>(s.items.size()), static_cast<double>(lengths[s.items[0]]));
  };
  std::vector<double> cost(d);
  for (Index r = 0; r < d; ++r) {
    const Index c = start[r + 1] - start[r];
    cost[r] = c == 0 ? 0.0 : conv_cost(cm, st[r].sum, static_cast<double>(c), static_cast<double>(mx[r]));
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
        const double new_a = (A.items.size() == 1) ? 0.0 : conv_cost(cm, A.sum - lx, ca - 1, ma_wo);
        const double new_b = conv_cost(cm, B.sum + lx, cb + 1, std::max(mb, lx));
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
          const double m2 = std::max(conv_cost(cm, A.sum - lx + ly, ca, ma2), conv_cost(cm, B.sum - ly + lx, cb, mb2));
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

namespace {
constexpr Index kSearchMaxItems = 64, kSearchMaxRanks = 16;
constexpr int64_t kSearchBudget = 200000;
constexpr Index kDifferencingMaxItems = 4096, kDifferencingMaxWork = 1 << 15;
constexpr Index kBesideItems = 100000;  // from here two candidates are built on two threads

// Within 1e-4 of the additive lower bound: nothing left worth a costlier candidate.
bool near_bound(const double* w, Index n, Index d, double makespan) {
  double total = 0.0, wmax = 0.0;
  for (Index i = 0; i < n; ++i) total += w[i], wmax = std::max(wmax, w[i]);
  return makespan <= std::max(wmax, total / static_cast<double>(d)) * (1.0 + 1e-4);
}
}  // namespace

std::vector<Index> balance(const int64_t* lengths, Index n, Index d, const CostModel& cm) {
  if (d < 1) throw std::invalid_argument("num_ranks must be >= 1");
  if (n == 0) return {};
  if (d == 1) return std::vector<Index>(n, 0);
  // Each local-search step costs O(b log b + log d); the budget keeps planning within a few
  // milliseconds at thousands of ranks (where LPT is already within ~1e-4 of the bound) and lets
  // small clusters, where the LPT tail matters most, search longer.
  const Index iters = std::min<Index>(4 * d + 64, std::max<Index>(32, 4000000 / std::max<Index>(n, 1)));
  // Few examples over few ranks: heuristics can miss the optimum by percents there, and a bounded
  // branch and bound (at most a few milliseconds) usually closes the gap.
  const bool small = n <= kSearchMaxItems && d <= kSearchMaxRanks;
  switch (cm.policy) {
    case Policy::Sum:
    case Policy::Quadratic: {
      const auto order = order_by_length_desc(lengths, n);
      double* w = scratch<double, 4>(n);
      for (Index i = 0; i < n; ++i) w[i] = item_weight(lengths[i], cm);
      std::vector<Index> best;
      auto first = [&] {
        best = lpt(w, order, d);
        refine_additive(w, n, d, best, iters);
      };
      if (cm.policy == Policy::Quadratic && cm.beta != 0.0) {
        // Algorithm 4 with a zero tolerance interval is LPT on plain sums: keep it as a candidate
        // (built beside the first on large problems: they are independent).
        std::vector<Index> alt;
        double alt_cost = 0.0;
        auto second = [&] {
          double* s = scratch<double, 11>(static_cast<size_t>(n));  // per thread, reused
          for (Index i = 0; i < n; ++i) s[i] = static_cast<double>(lengths[i]);
          alt = lpt(s, order, d);
          refine_additive(w, n, d, alt, iters);
          alt_cost = max_cost(lengths, n, alt, d, cm);
        };
        if (n >= kBesideItems)
          run_beside(second, first);
        else
          first(), second();
        if (alt_cost < max_cost(lengths, n, best, d, cm)) best.swap(alt);
      } else {
        first();
      }
      if (small || (n <= kDifferencingMaxItems && n * d <= kDifferencingMaxWork &&
                    !near_bound(w, n, d, max_cost(lengths, n, best, d, cm)))) {
        // many examples per rank: differencing often finds a near-perfect split that LPT misses
        auto alt = largest_differencing(w, n, d);
        refine_additive(w, n, d, alt, iters);
        if (max_cost(lengths, n, alt, d, cm) < max_cost(lengths, n, best, d, cm)) best.swap(alt);
      }
      if (small) improve_small(lengths, n, d, cm, best, kSearchBudget);
      return best;
    }
    case Policy::Padded:
      return padded_optimal(lengths, n, d);
    case Policy::PaddedQuadratic:
      return padded_general_optimal(lengths, n, d, cm);
    case Policy::Conv: {
      auto best = balance_conv(lengths, n, d, cm, std::min<Index>(iters, 1024));
      if (small) improve_small(lengths, n, d, cm, best, kSearchBudget);
      return best;
    }
  }
  throw std::invalid_argument("unknown policy");
}

}  // namespace mmb
