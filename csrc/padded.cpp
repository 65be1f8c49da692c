// Exact padded planning (padded.hpp): greedy from the largest under a bound, binary search on the
// bound. The paper's algorithm 2 searches with an ascending greedy that can miss the optimum.
#include "padded.hpp"

#include <algorithm>
#include <cmath>
#include <limits>

#include "bisect.hpp"

namespace mmb {

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

}  // namespace mmb
