// Compressed rows: items grouped by an integer key with one counting sort (internal helper).
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

struct Csr {
  std::vector<Index> start, order;
  // items in `visit` order (all of 0..n-1 when null) grouped by key, keeping that order per key
  void build(const Index* key, Index n, Index keys, const Index* visit = nullptr) {
    start.assign(keys + 1, 0);
    for (Index i = 0; i < n; ++i) ++start[key[i] + 1];
    for (Index k = 0; k < keys; ++k) start[k + 1] += start[k];
    order.resize(n);
    std::vector<Index> fill(start.begin(), start.end() - 1);
    for (Index j = 0; j < n; ++j) {
      const Index i = visit ? visit[j] : j;
      order[fill[key[i]]++] = i;
    }
  }
};

}  // namespace mmb
