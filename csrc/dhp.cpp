// Dynamic context-parallel groups (dhp.txt section 4.3), and better.
//
// The paper: best-fit-decreasing (BFD) packs sequences into memory-full atomic groups, then a 2-D
// DP gives each group a degree (O(g N^2)). Memory-full groups can be badly balanced in time, so we
// keep the paper's candidate and add one per static uniform degree c (N / c groups of c ranks,
// sequences longest-first to the group that stays fastest) and "mixed" ones (every sequence too
// slow or too large for one rank alone on the fewest ranks that fix it, the rest spread over
// degree-1 groups; retried with the best makespan found as the target). Every candidate gets
// optimal degrees (an exact threshold search, the same optimum as the DP in O(g N log) instead of
// O(g N^2)), the best ones a few rounds of regrouping for the degrees found (spare ranks become
// new groups). The static candidates make the result never worse than the best static uniform CP
// degree; the paper's candidate makes it never worse than the paper.
#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <utility>

#include "planners.hpp"

namespace mmb {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

struct Agg {
  double s1 = 0.0;
  double s2 = 0.0;
  Index count = 0;
  int64_t tokens = 0;
  void add(int64_t l) {
    const double x = static_cast<double>(l);
    s1 += x;
    s2 += x * x;
    ++count;
    tokens += l;
  }
};

// A grouping of the sequences with its degrees and makespan.
struct Candidate {
  std::vector<Index> group_of;
  std::vector<Index> degree;
  double makespan = kInf;
  const char* method = "";
};

// Non-negative doubles order like their bit patterns, so the smallest feasible threshold can be
// found exactly by binary search on the integers.
uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
double double_of(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

std::vector<Agg> aggregates(const int64_t* lengths, Index n, const std::vector<Index>& group_of, Index g) {
  std::vector<Agg> agg(g);
  for (Index i = 0; i < n; ++i) agg[group_of[i]].add(lengths[i]);
  return agg;
}

// Optimal degrees for the groups of `c` under `cost`; fills c.degree and c.makespan.
void solve_degrees(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                   Candidate& c) {
  Index g = 0;
  for (Index i = 0; i < n; ++i) g = std::max(g, c.group_of[i] + 1);
  const auto agg = aggregates(lengths, n, c.group_of, g);
  std::vector<Index> dmin(g);
  Index total = 0;
  for (Index k = 0; k < g; ++k) total += dmin[k] = min_degree(agg[k].tokens, mem);
  c.degree.clear();
  c.makespan = kInf;
  if (total > num_ranks) return;
  const Index w = num_ranks + 1;
  std::vector<double> table(static_cast<size_t>(g) * w, kInf);
  for (Index k = 0; k < g; ++k) {
    const Index hi = num_ranks - (total - dmin[k]);
    for (Index d = dmin[k]; d <= hi; ++d) table[k * w + d] = cost.time(agg[k].s1, agg[k].s2, agg[k].count, d);
  }
  double ms = kInf;
  c.degree = optimal_degrees(table.data(), g, num_ranks, dmin.data(), &ms);
  c.makespan = c.degree.empty() ? kInf : ms;
}

// Longest first, each sequence to the group whose time after adding it is smallest (ties: lowest
// group), among the groups with memory left. Returns false if a sequence fits nowhere.
bool greedy_assign(const int64_t* lengths, const std::vector<Index>& order, const std::vector<Index>& degree,
                   int64_t mem, const CpCost& cost, std::vector<Index>& group_of, std::vector<Agg>* out) {
  const Index g = static_cast<Index>(degree.size());
  std::vector<Agg> agg(g);
  for (Index i : order) {
    const int64_t l = lengths[i];
    const double x = static_cast<double>(l);
    Index best = -1;
    double best_t = kInf;
    for (Index k = 0; k < g; ++k) {
      if (agg[k].tokens + l > degree[k] * mem) continue;
      const double t = cost.time(agg[k].s1 + x, agg[k].s2 + x * x, agg[k].count + 1, degree[k]);
      if (t < best_t) {
        best_t = t;
        best = k;
      }
    }
    if (best < 0) return false;
    agg[best].add(l);
    group_of[i] = best;
  }
  if (out) *out = std::move(agg);
  return true;
}

// Renumber groups 0..g'-1 dropping empty ones (first appearance in `order` keeps it stable).
void compact(std::vector<Index>& group_of, std::vector<Index>* degree) {
  Index g = 0;
  for (Index k : group_of) g = std::max(g, k + 1);
  std::vector<Index> map(g, -1);
  Index next = 0;
  for (Index& k : group_of) {
    if (map[k] < 0) map[k] = next++;
    k = map[k];
  }
  if (degree) {
    std::vector<Index> nd(next);
    for (Index k = 0; k < g; ++k)
      if (map[k] >= 0) nd[map[k]] = (*degree)[k];
    *degree = std::move(nd);
  }
}

// Regroup for the degrees found (spare ranks as new degree-1 groups), re-solve the degrees; keep
// going while the makespan improves.
void improve(const int64_t* lengths, Index n, const std::vector<Index>& order, Index num_ranks, int64_t mem,
             const CpCost& cost, Index rounds, Candidate& best) {
  Candidate cur = best;
  for (Index r = 0; r < rounds && !cur.degree.empty(); ++r) {
    std::vector<Index> degree = cur.degree;
    Index used = 0;
    for (Index d : degree) used += d;
    for (Index s = used; s < num_ranks; ++s) degree.push_back(1);
    Candidate next;
    next.group_of.assign(n, 0);
    next.method = best.method;
    if (!greedy_assign(lengths, order, degree, mem, cost, next.group_of, nullptr)) return;
    compact(next.group_of, nullptr);
    solve_degrees(lengths, n, num_ranks, mem, cost, next);
    if (!(next.makespan < cur.makespan)) return;
    cur = std::move(next);
    if (cur.makespan < best.makespan) best = cur;
  }
}

// Sequences whose single time on their fewest ranks exceeds `target` get a group of their own with
// the fewest ranks that bring them under it (memory minimum with target = inf); the rest of the
// ranks become degree-1 groups; then greedy assignment and optimal degrees.
bool mixed_start(const int64_t* lengths, Index n, const std::vector<Index>& order, Index num_ranks, int64_t mem,
                 const CpCost& cost, double target, Candidate& out) {
  std::vector<Index> degree;
  Index used = 0;
  for (Index i : order) {
    const double x = static_cast<double>(lengths[i]);
    Index d = min_degree(lengths[i], mem);
    while (d < num_ranks && cost.time(x, x * x, 1, d) > target) ++d;
    if (d == 1) break;
    degree.push_back(d);
    used += d;
    if (used > num_ranks) return false;
  }
  if (degree.empty()) return false;
  for (Index s = used; s < num_ranks; ++s) degree.push_back(1);
  out.group_of.assign(n, 0);
  out.method = std::isfinite(target) ? "mixed-time" : "mixed-memory";
  if (!greedy_assign(lengths, order, degree, mem, cost, out.group_of, nullptr)) return false;
  compact(out.group_of, nullptr);
  solve_degrees(lengths, n, num_ranks, mem, cost, out);
  return std::isfinite(out.makespan);
}

// max(best single-sequence time, (linear * S1 + attention * S2) / N): every group of degree d and
// time T does at least d * T >= its linear + attention work.
double lower_bound(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost) {
  double work = 0.0, single = 0.0;
  for (Index i = 0; i < n; ++i) {
    const double x = static_cast<double>(lengths[i]);
    work += cost.linear * x + cost.attn * x * x;
    double best = kInf;
    for (Index d = min_degree(lengths[i], mem); d <= num_ranks; ++d)
      best = std::min(best, cost.time(x, x * x, 1, d));
    single = std::max(single, best);
  }
  return std::max(single, work / static_cast<double>(num_ranks));
}

}  // namespace

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

std::vector<Index> optimal_degrees(const double* table, Index g, Index num_ranks, const Index* dmin,
                                   double* makespan) {
  Index total = 0;
  for (Index k = 0; k < g; ++k) total += dmin[k];
  if (total > num_ranks) return {};
  const Index w = num_ranks + 1;
  // env[k][d]: best time on at most d ranks (non-increasing), for d in [dmin_k, hi_k].
  std::vector<double> env(static_cast<size_t>(g) * w, kInf);
  std::vector<Index> hi(g);
  double top = 0.0;
  for (Index k = 0; k < g; ++k) {
    hi[k] = num_ranks - (total - dmin[k]);
    double run = kInf;
    for (Index d = dmin[k]; d <= hi[k]; ++d) env[k * w + d] = run = std::min(run, table[k * w + d]);
    top = std::max(top, env[k * w + dmin[k]]);
  }
  // need_k(tau): fewest ranks with env <= tau (binary search on the non-increasing row).
  auto need = [&](Index k, double tau) -> Index {
    const double* row = env.data() + k * w;
    if (row[hi[k]] > tau) return -1;
    Index lo = dmin[k], up = hi[k];
    while (lo < up) {
      const Index mid = (lo + up) / 2;
      if (row[mid] <= tau) {
        up = mid;
      } else {
        lo = mid + 1;
      }
    }
    return lo;
  };
  auto feasible = [&](double tau) {
    Index sum = 0;
    for (Index k = 0; k < g; ++k) {
      const Index d = need(k, tau);
      if (d < 0) return false;
      sum += d;
      if (sum > num_ranks) return false;
    }
    return true;
  };
  if (!std::isfinite(top)) return {};
  uint64_t lo = 0, up = bits_of(top);  // feasible(top): every group on its minimum degree
  while (lo < up) {
    const uint64_t mid = lo + (up - lo) / 2;
    if (feasible(double_of(mid))) {
      up = mid;
    } else {
      lo = mid + 1;
    }
  }
  const double tau = double_of(up);
  std::vector<Index> degree(g);
  for (Index k = 0; k < g; ++k) degree[k] = need(k, tau);
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
  // dhp.txt algorithm 1 backtracks from DP[K'][N]: all ranks are used.
  if (!std::isfinite(dp[g * w + num_ranks])) return {};
  std::vector<Index> degree(g);
  for (Index k = g, j = num_ranks; k >= 1; --k) {
    degree[k - 1] = path[k * w + j];
    j -= degree[k - 1];
  }
  *makespan = dp[g * w + num_ranks];
  return degree;
}

void layout_ranks(const std::vector<Index>& degree, Index num_ranks, Index ranks_per_node,
                  std::vector<Index>& offset, std::vector<Index>& ranks) {
  const Index g = static_cast<Index>(degree.size());
  offset.assign(g + 1, 0);
  ranks.clear();
  std::vector<char> used(num_ranks, 0);
  const bool nodes = ranks_per_node > 0 && num_ranks % ranks_per_node == 0;
  const Index num_nodes = nodes ? num_ranks / ranks_per_node : 0;
  std::vector<Index> free_in(num_nodes, ranks_per_node);
  auto take = [&](Index r) {
    used[r] = 1;
    ranks.push_back(r);
    if (nodes) --free_in[r / ranks_per_node];
  };
  for (Index k = 0; k < g; ++k) {
    const Index d = degree[k];
    const size_t start = ranks.size();
    bool placed = false;
    if (nodes) {
      // whole free nodes for the full part, then the best-fitting node for the rest
      std::vector<Index> whole;
      for (Index v = 0; v < num_nodes && static_cast<Index>(whole.size()) < d / ranks_per_node; ++v)
        if (free_in[v] == ranks_per_node) whole.push_back(v);
      const Index rest = d % ranks_per_node;
      Index fit = -1;
      if (static_cast<Index>(whole.size()) == d / ranks_per_node && rest > 0) {
        for (Index v = 0; v < num_nodes; ++v) {
          if (std::find(whole.begin(), whole.end(), v) != whole.end()) continue;
          if (free_in[v] >= rest && (fit < 0 || free_in[v] < free_in[fit])) fit = v;
        }
      }
      if (static_cast<Index>(whole.size()) == d / ranks_per_node && (rest == 0 || fit >= 0)) {
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
    if (!placed) {
      for (Index r = 0, left = d; left > 0 && r < num_ranks; ++r)
        if (!used[r]) {
          take(r);
          --left;
        }
    }
    std::sort(ranks.begin() + start, ranks.end());
    offset[k + 1] = static_cast<Index>(ranks.size());
  }
}

CpResult cp_schedule(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                     Index ranks_per_node, Index max_rounds) {
  CpResult res;
  if (n == 0) {
    res.rank_offset.assign(1, 0);
    res.method = "empty";
    res.static_makespan = res.paper_makespan = 0.0;
    return res;
  }
  const auto order = order_by_length_desc(lengths, n);
  std::vector<Candidate> starts;

  // the paper: BFD atomic groups + optimal degrees
  {
    Candidate c;
    std::vector<Index> dmin;
    c.group_of = bfd_groups(lengths, n, mem, dmin);
    c.method = "paper";
    solve_degrees(lengths, n, num_ranks, mem, cost, c);
    res.paper_makespan = std::isfinite(c.makespan) ? c.makespan : -1.0;
    starts.push_back(std::move(c));
  }
  // every static uniform degree
  for (Index c = 1; c <= num_ranks; ++c) {
    const Index g = num_ranks / c;
    Candidate cand;
    cand.group_of.assign(n, 0);
    std::vector<Index> degree(g, c);
    std::vector<Agg> agg;
    if (!greedy_assign(lengths, order, degree, mem, cost, cand.group_of, &agg)) continue;
    double ms = 0.0;
    for (Index k = 0; k < g; ++k) ms = std::max(ms, cost.time(agg[k].s1, agg[k].s2, agg[k].count, c));
    if (res.static_makespan < 0 || ms < res.static_makespan) {
      res.static_makespan = ms;
      res.static_degree = c;
    }
    compact(cand.group_of, nullptr);
    cand.method = "static+dp";
    solve_degrees(lengths, n, num_ranks, mem, cost, cand);
    starts.push_back(std::move(cand));
  }
  // mixed, by memory: long sequences alone on their minimum degree
  {
    Candidate cand;
    if (mixed_start(lengths, n, order, num_ranks, mem, cost, kInf, cand)) starts.push_back(std::move(cand));
  }
  // improve the three best starts
  std::vector<Index> idx(starts.size());
  for (size_t i = 0; i < idx.size(); ++i) idx[i] = static_cast<Index>(i);
  std::stable_sort(idx.begin(), idx.end(), [&](Index a, Index b) { return starts[a].makespan < starts[b].makespan; });
  Candidate best;
  for (size_t j = 0; j < idx.size(); ++j) {
    Candidate c = starts[idx[j]];
    if (!std::isfinite(c.makespan)) break;
    if (j < 3) improve(lengths, n, order, num_ranks, mem, cost, max_rounds, c);
    if (c.makespan < best.makespan) best = std::move(c);
  }
  // mixed, by time: sequences slower than the best makespan alone get their own groups; retry
  // while that helps, then once halfway to the lower bound
  const double lb = lower_bound(lengths, n, num_ranks, mem, cost);
  res.lower_bound = lb;
  for (Index r = 0, halfway = 0; r < 4 && std::isfinite(best.makespan); ++r) {
    const double target = halfway ? 0.5 * (best.makespan + lb) : best.makespan;
    Candidate c;
    bool better = false;
    if (mixed_start(lengths, n, order, num_ranks, mem, cost, target, c)) {
      improve(lengths, n, order, num_ranks, mem, cost, max_rounds, c);
      if (c.makespan < best.makespan) {
        best = std::move(c);
        better = true;
      }
    }
    if (!better) {
      if (halfway) break;
      halfway = 1;
    }
  }
  if (!std::isfinite(best.makespan)) return res;  // nothing fits: the caller reports it

  // output order: degree descending, then smallest sequence index
  const Index g = static_cast<Index>(best.degree.size());
  std::vector<Index> first(g, n);
  for (Index i = n - 1; i >= 0; --i) first[best.group_of[i]] = i;
  std::vector<Index> perm(g);
  for (Index k = 0; k < g; ++k) perm[k] = k;
  std::stable_sort(perm.begin(), perm.end(), [&](Index a, Index b) {
    if (best.degree[a] != best.degree[b]) return best.degree[a] > best.degree[b];
    return first[a] < first[b];
  });
  std::vector<Index> rank_of(g);
  for (Index k = 0; k < g; ++k) rank_of[perm[k]] = k;
  res.group_of.resize(n);
  for (Index i = 0; i < n; ++i) res.group_of[i] = rank_of[best.group_of[i]];
  res.degree.resize(g);
  for (Index k = 0; k < g; ++k) res.degree[k] = best.degree[perm[k]];
  const auto agg = aggregates(lengths, n, res.group_of, g);
  res.time.resize(g);
  res.makespan = 0.0;
  for (Index k = 0; k < g; ++k) {
    res.time[k] = cost.time(agg[k].s1, agg[k].s2, agg[k].count, res.degree[k]);
    res.makespan = std::max(res.makespan, res.time[k]);
  }
  res.method = best.method;
  layout_ranks(res.degree, num_ranks, ranks_per_node, res.rank_offset, res.ranks);
  return res;
}

}  // namespace mmb
