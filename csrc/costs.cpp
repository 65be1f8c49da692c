// Batch costs and the length order (costs.hpp).
#include "costs.hpp"

#include <algorithm>

#include "radix.hpp"
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

}  // namespace mmb
