// The parts of a dynamic CP schedule that do not search (DHP section 4.3): a sequence's memory
// minimum, the paper's best-fit-decreasing atomic groups, optimal degrees of fixed groups (the exact
// threshold search, and the paper's 2-D DP as reference), and the layout of groups on ranks. The
// search that uses them is dhp.cpp.
#include <algorithm>
#include <cmath>
#include <set>
#include <utility>
#include <vector>

#include "cp_costs.hpp"
#include "schedulers.hpp"

namespace mmb {

using namespace dhp_detail;

Index min_degree(int64_t l, int64_t mem) { return l <= mem ? 1 : (l + mem - 1) / mem; }

std::vector<Index> bfd_groups(const int64_t* lengths, Index n, int64_t mem, std::vector<Index>& dmin) {
  const auto order = order_by_length_desc(lengths, n);
  std::vector<Index> group_of(n);
  std::set<std::pair<int64_t, Index>> room;  // (free tokens, bin): best fit = first with room >= l
  std::vector<int64_t> free_tokens;
  dmin.clear();
  for (Index i : order) {
    const int64_t l = lengths[i];
    auto it = room.lower_bound({l, -1});
    Index b;
    if (it == room.end()) {
      b = static_cast<Index>(dmin.size());
      dmin.push_back(min_degree(l, mem));
      free_tokens.push_back(dmin.back() * mem);
    } else {
      b = it->second;
      room.erase(it);
    }
    free_tokens[b] -= l;
    room.insert({free_tokens[b], b});
    group_of[i] = b;
  }
  return group_of;
}

std::vector<Index> optimal_degrees(const double* table, Index g, Index num_ranks, const Index* dmin, double* makespan) {
  Index total = 0;
  for (Index k = 0; k < g; ++k) total += dmin[k];
  if (total > num_ranks) return {};
  const Index w = num_ranks + 1;
  // env[k][d]: best time on at most d ranks (non-increasing), for d in [dmin_k, hi_k].
  std::vector<double> env(static_cast<size_t>(g) * w, kInf);
  std::vector<Index> hi(g);
  for (Index k = 0; k < g; ++k) {
    hi[k] = num_ranks - (total - dmin[k]);
    double run = kInf;
    for (Index d = dmin[k]; d <= hi[k]; ++d) env[k * w + d] = run = std::min(run, table[k * w + d]);
  }
  auto degree = threshold_degrees(g, num_ranks, dmin, hi.data(), [&](Index k, Index d) { return env[k * w + d]; });
  if (degree.empty()) return degree;
  *makespan = 0.0;
  for (Index k = 0; k < g; ++k) *makespan = std::max(*makespan, table[k * w + degree[k]]);
  return degree;
}

std::vector<Index> paper_dp_degrees(const double* table, Index g, Index num_ranks, const Index* dmin,
                                    double* makespan) {
  Index total = 0;
  for (Index k = 0; k < g; ++k) total += dmin[k];
  if (total > num_ranks) return {};
  const Index w = num_ranks + 1;
  std::vector<double> dp(static_cast<size_t>(g + 1) * w, kInf);
  std::vector<Index> path(static_cast<size_t>(g + 1) * w, 0);
  dp[0] = 0.0;
  Index before = 0;  // sum of dmin of the groups before k
  for (Index k = 1; k <= g; ++k) {
    const Index after = total - before - dmin[k - 1];
    for (Index j = before + dmin[k - 1]; j <= num_ranks - after; ++j) {
      for (Index d = dmin[k - 1]; d <= j - before; ++d) {
        const double c = std::max(dp[(k - 1) * w + j - d], table[(k - 1) * w + d]);
        if (c < dp[k * w + j]) {
          dp[k * w + j] = c;
          path[k * w + j] = d;
        }
      }
    }
    before += dmin[k - 1];
  }
  // DHP algorithm 1 backtracks from DP[K'][N]: all ranks are used.
  if (!std::isfinite(dp[g * w + num_ranks])) return {};
  std::vector<Index> degree(g);
  for (Index k = g, j = num_ranks; k >= 1; --k) {
    degree[k - 1] = path[k * w + j];
    j -= degree[k - 1];
  }
  *makespan = dp[g * w + num_ranks];
  return degree;
}

void layout_ranks(const std::vector<Index>& degree, Index num_ranks, Index ranks_per_node, std::vector<Index>& offset,
                  std::vector<Index>& ranks) {
  const Index g = static_cast<Index>(degree.size());
  offset.assign(g + 1, 0);
  ranks.clear();
  std::vector<char> used(num_ranks, 0);
  const bool nodes = ranks_per_node > 0 && num_ranks % ranks_per_node == 0;
  const Index num_nodes = nodes ? num_ranks / ranks_per_node : 0;
  std::vector<Index> free_in(num_nodes, ranks_per_node);
  std::vector<char> whole_node(num_nodes, 0);
  Index first_free = 0;  // every rank below it is taken
  auto take = [&](Index r) {
    used[r] = 1;
    ranks.push_back(r);
    if (nodes) --free_in[r / ranks_per_node];
  };
  std::vector<Index> whole;
  for (Index k = 0; k < g; ++k) {
    const Index d = degree[k];
    const size_t start = ranks.size();
    bool placed = false;
    if (nodes) {
      // whole free nodes for the full part, then the best-fitting node for the rest
      const Index full = d / ranks_per_node, rest = d % ranks_per_node;
      whole.clear();
      for (Index v = 0; v < num_nodes && static_cast<Index>(whole.size()) < full; ++v)
        if (free_in[v] == ranks_per_node) whole.push_back(v);
      if (static_cast<Index>(whole.size()) == full) {
        Index fit = -1;
        if (rest > 0) {
          for (Index v : whole) whole_node[v] = 1;
          for (Index v = 0; v < num_nodes; ++v)
            if (!whole_node[v] && free_in[v] >= rest && (fit < 0 || free_in[v] < free_in[fit])) fit = v;
          for (Index v : whole) whole_node[v] = 0;
        }
        if (rest == 0 || fit >= 0) {
          for (Index v : whole)
            for (Index r = v * ranks_per_node; r < (v + 1) * ranks_per_node; ++r) take(r);
          for (Index r = fit * ranks_per_node, left = rest; left > 0; ++r)
            if (!used[r]) {
              take(r);
              --left;
            }
          placed = true;
        }
      }
    }
    if (!placed) {
      while (first_free < num_ranks && used[first_free]) ++first_free;
      for (Index r = first_free, left = d; left > 0 && r < num_ranks; ++r)
        if (!used[r]) {
          take(r);
          --left;
        }
    }
    std::sort(ranks.begin() + start, ranks.end());
    offset[k + 1] = static_cast<Index>(ranks.size());
  }
}

}  // namespace mmb
