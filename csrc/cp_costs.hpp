// Internals of dhp.cpp: the two forms of a group's time (the closed-form CpCost and a per-sequence
// table) and the exact optimal-degree search they share. Included by dhp.cpp and cp_groups.cpp only.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <queue>
#include <set>
#include <tuple>
#include <utility>
#include <vector>

#include "schedulers.hpp"

namespace mmb {
namespace dhp_detail {

inline constexpr double kInf = std::numeric_limits<double>::infinity();
inline constexpr Index kScanGroups = 16;                    // greedy scans all groups up to this many
inline constexpr int64_t kStaticBudget = int64_t{1} << 20;  // sequences x greedy static degrees
inline constexpr int64_t kStaticExhaustive = int64_t{1} << 16;  // sweeps this small try every degree
inline constexpr int64_t kStaticSolves = int64_t{1} << 26;  // work of their optimal-degree solves
inline constexpr size_t kStaticStarts = 8;                  // groupings solved at least
inline constexpr Index kScanDegrees = 64;                   // degree search scans windows this small
inline constexpr Index kMixedRounds = 3;                   // rounds of the mixed-by-time search
inline constexpr double kMixedGap = 1e-4;                   // it stops this close to its floor
inline constexpr double kImproveWithin = 1.15;              // candidates regrouped: this close to the best
inline constexpr int64_t kParallelWork = int64_t{1} << 18;  // sequences x ranks from which two threads plan

// A group while it is filled: time at its degree, sums of l and l^2, tokens, sequences.
struct Acc {
  double t = 0.0;
  double s1 = 0.0;
  double s2 = 0.0;
  double se = 0.0;  // sum of the sequences' extra seconds (CpModel::extra), spread over the degree
  int64_t tokens = 0;
  Index count = 0;
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
inline uint64_t bits_of(double x) {
  uint64_t u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
inline double double_of(uint64_t u) {
  double x;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// The smallest tau with sum_k need_k(tau) <= num_ranks, need_k(tau) = the first d in
// [dmin_k, best_k] with time(k, d) <= tau, where time(k, .) does not increase on that range and
// time(k, best_k) is the group's best. Returns need_k at that tau (empty: infeasible).
template <class Time>
std::vector<Index> threshold_degrees(Index g, Index num_ranks, const Index* dmin, const Index* best, const Time& time) {
  Index total = 0;
  for (Index k = 0; k < g; ++k) total += dmin[k];
  if (total > num_ranks) return {};
  std::vector<double> floor_t(g);
  double lo_t = 0.0, hi_t = 0.0;
  for (Index k = 0; k < g; ++k) {
    floor_t[k] = time(k, best[k]);
    lo_t = std::max(lo_t, floor_t[k]);
    hi_t = std::max(hi_t, time(k, dmin[k]));  // feasible: every group on its minimum degree
  }
  if (!std::isfinite(hi_t)) return {};
  // need_k falls as tau grows: between a feasible and an infeasible tau it lies in [lo_k, up_k],
  // so each search only covers what the thresholds tried so far left open.
  std::vector<Index> lo_d(dmin, dmin + g), up_d(best, best + g), cur(g), degree(dmin, dmin + g);
  Index done = 0;  // needs computed by the last call
  auto needs = [&](double tau) {
    Index sum = 0;
    for (done = 0; done < g; ++done) {
      const Index k = done;
      if (floor_t[k] > tau) return false;
      Index lo = lo_d[k], up = up_d[k];
      while (lo < up) {
        const Index mid = lo + (up - lo) / 2;
        if (time(k, mid) <= tau) {
          up = mid;
        } else {
          lo = mid + 1;
        }
      }
      cur[k] = lo;
      if ((sum += lo) > num_ranks) {
        ++done;
        return false;
      }
    }
    return true;
  };
  auto narrow = [&](bool feasible) {
    if (feasible) {
      degree = cur;
      lo_d = cur;
    } else {
      std::copy(cur.begin(), cur.begin() + done, up_d.begin());
    }
    return feasible;
  };
  // Few spare ranks: hand them one at a time to the slowest group (optimal for non-increasing
  // times); the threshold is the slowest time then. Else (or if rounding upsets that) bisection.
  if (num_ranks - total <= 32 * g) {
    std::vector<Index> d(dmin, dmin + g);
    std::priority_queue<std::pair<double, Index>> slowest;
    for (Index k = 0; k < g; ++k) slowest.push({time(k, d[k]), k});
    for (Index spare = num_ranks - total; spare > 0 && d[slowest.top().second] < best[slowest.top().second]; --spare) {
      const Index k = slowest.top().second;
      slowest.pop();
      slowest.push({time(k, ++d[k]), k});
    }
    if (needs(slowest.top().first)) return cur;
  }
  uint64_t lo = bits_of(lo_t), up = bits_of(hi_t);
  while (lo < up) {
    const uint64_t mid = lo + (up - lo) / 2;
    if (narrow(needs(double_of(mid)))) {
      up = mid;
    } else {
      lo = mid + 1;
    }
  }
  return degree;
}

// The closed form: CpCost of a group's sums, plus, when `extra` is set, each sequence's extra
// seconds spread evenly over the group's ranks (a VLM group's members encoding its media): a group
// of degree d takes cost.time(...) + sum(extra) / d, a term of the form of the linear one.
struct CpModel {
  const int64_t* len;
  Index n;
  Index num_ranks;
  int64_t mem;
  CpCost cost;
  const double* extra = nullptr;  // [n] or null
  static constexpr bool kThreadSafe = true;  // const methods only: two threads may share it

  double extra_of(Index i) const { return extra ? extra[i] : 0.0; }
  double time(const Acc& a, Index d) const {
    return cost.time(a.s1, a.s2, a.count, d) + (a.count ? a.se / static_cast<double>(d) : 0.0);
  }
  double alone(Index i, Index d) const {
    const double x = static_cast<double>(len[i]);
    return cost.time(x, x * x, 1, d) + extra_of(i) / static_cast<double>(d);
  }
  double after(const Acc& a, Index i, Index d) const {
    const double x = static_cast<double>(len[i]);
    return cost.time(a.s1 + x, a.s2 + x * x, a.count + 1, d) + (a.se + extra_of(i)) / static_cast<double>(d);
  }
  void add(Acc& a, Index i, Index d) const {
    const double x = static_cast<double>(len[i]);
    a.s1 += x;
    a.s2 += x * x;
    a.se += extra_of(i);
    a.tokens += len[i];
    ++a.count;
    a.t = time(a, d);
  }
  // 1 for a group whose ring exchange outlasts its attention (overlap only), else 0: adding to it
  // grows its time by at least the ring growth, else by at least the attention growth.
  int regime(const Acc& a, Index d) const {
    if (!cost.overlap || d == 1) return 0;
    const double dd = static_cast<double>(d);
    return cost.attn * a.s2 / dd < cost.ring * a.s1 * (dd - 1.0) / dd + cost.ring_latency * (dd - 1.0);
  }
  // At most after(a, i, d) - a.t for a non-empty group of the regime: linear x / d plus the
  // attention growth, the ring growth, or both without overlap.
  double least_increase(Index i, int reg, Index d) const {
    const double x = static_cast<double>(len[i]), dd = static_cast<double>(d);
    const double attn = reg == 0 || !cost.overlap ? cost.attn * x * x : 0.0;
    const double ring = reg == 1 || !cost.overlap ? cost.ring * x * (dd - 1.0) : 0.0;
    return (cost.linear * x + attn + ring + extra_of(i)) / dd;
  }
  // No group of time t can beat `best` (the margin covers rounding of the bound above).
  static bool beyond(double t, double inc, double best) { return (t + inc) * (1.0 - 1e-12) > best; }

  // A degree in [lo, hi] with the smallest time: times are quasi-convex in d, so a ternary search
  // narrows to a window, scanned for its first minimum.
  Index best_degree(const Acc& a, Index lo, Index hi) const {
    while (hi - lo > kScanDegrees) {
      const Index m1 = lo + (hi - lo) / 3, m2 = hi - (hi - lo) / 3;
      if (time(a, m1) <= time(a, m2)) {
        hi = m2;
      } else {
        lo = m1;
      }
    }
    Index b = lo;
    double bt = time(a, lo);
    for (Index d = lo + 1; d <= hi; ++d) {
      const double t = time(a, d);
      if (t < bt) {
        bt = t;
        b = d;
      }
    }
    return b;
  }
  std::vector<Acc> sums(const std::vector<Index>& group_of, Index g) const {
    std::vector<Acc> acc(g);
    for (Index i = 0; i < n; ++i) {
      Acc& a = acc[group_of[i]];
      const double x = static_cast<double>(len[i]);
      a.s1 += x;
      a.s2 += x * x;
      a.se += extra_of(i);
      a.tokens += len[i];
      ++a.count;
    }
    return acc;
  }
  // Optimal degrees of the groups of c.group_of (g of them); fills c.degree and c.makespan.
  void solve(Index g, Candidate& c) const {
    const auto acc = sums(c.group_of, g);
    std::vector<Index> dmin(g), best(g);
    Index total = 0;
    for (Index k = 0; k < g; ++k) total += dmin[k] = min_degree(acc[k].tokens, mem);
    c.degree.clear();
    c.makespan = kInf;
    if (total > num_ranks) return;
    for (Index k = 0; k < g; ++k) best[k] = best_degree(acc[k], dmin[k], num_ranks - (total - dmin[k]));
    auto t = [&](Index k, Index d) { return time(acc[k], d); };
    c.degree = threshold_degrees(g, num_ranks, dmin.data(), best.data(), t);
    if (c.degree.empty()) return;
    c.makespan = 0.0;
    for (Index k = 0; k < g; ++k) c.makespan = std::max(c.makespan, t(k, c.degree[k]));
  }
  // About the time evaluations of solve() on g groups: a bisection on the threshold's 64 bits.
  int64_t solve_work(Index g) const {
    int64_t log = 1;
    while ((int64_t{1} << log) <= num_ranks) ++log;
    return g * 64 * log;
  }
  std::vector<double> group_times(const std::vector<Index>& group_of, const std::vector<Index>& degree) const {
    const auto acc = sums(group_of, static_cast<Index>(degree.size()));
    std::vector<double> out(degree.size());
    for (size_t k = 0; k < out.size(); ++k) out[k] = time(acc[k], degree[k]);
    return out;
  }
  // Static degree c with every sequence alone: the longest is the slowest (time grows with l)
  // unless extra seconds make a shorter one slower.
  double static_alone(Index c, Index longest) const {
    if (!extra) return alone(longest, c);
    double worst = 0.0;
    for (Index i = 0; i < n; ++i) worst = std::max(worst, alone(i, c));
    return worst;
  }
  // The sums of all sequences, for static_bound.
  Acc totals() const {
    Acc a;
    for (Index i = 0; i < n; ++i) {
      const double x = static_cast<double>(len[i]);
      a.s1 += x;
      a.s2 += x * x;
      a.se += extra_of(i);
    }
    return a;
  }
  // No grouping of static degree c (num_ranks / c groups of c ranks) is faster: its group with the
  // longest sequence takes at least that sequence alone (times grow with the sums), and the groups
  // together at least the linear, attention and ring work of all sequences (a sum of maxima is at
  // least the maximum of the sums; per-group constants left out).
  double static_bound(Index c, Index longest, const Acc& all) const {
    const double dd = static_cast<double>(c);
    const double a = cost.attn * all.s2 / dd;
    const double r = c > 1 ? cost.ring * all.s1 * (dd - 1.0) / dd : 0.0;
    const double work = (cost.linear * all.s1 + all.se) / dd + (cost.overlap ? std::max(a, r) : a + r);
    return std::max(alone(longest, c), work / static_cast<double>(num_ranks / c));
  }
  // max(the longest sequence alone on its best degree, (linear * S1 + attention * S2 + extra) / N):
  // every group of degree d and time T does at least d * T >= its linear, attention and extra work.
  double lower_bound(Index longest) const {
    double work = 0.0;
    for (Index i = 0; i < n; ++i) {
      const double x = static_cast<double>(len[i]);
      work += cost.linear * x + cost.attn * x * x + extra_of(i);
    }
    Acc a;
    add(a, longest, 1);
    const double single = time(a, best_degree(a, min_degree(len[longest], mem), num_ranks));
    return std::max(single, work / static_cast<double>(num_ranks));
  }
  // Fewest ranks on which sequence i alone takes at most `target` (else its best degree).
  Index fewest_ranks(Index i, double target) const {
    const Index lo = min_degree(len[i], mem);
    if (!std::isfinite(target)) return lo;
    Acc a;
    add(a, i, 1);
    Index up = best_degree(a, lo, num_ranks);
    if (time(a, up) > target) return up;
    for (Index l = lo; l < up;) {
      const Index mid = l + (up - l) / 2;
      if (time(a, mid) <= target) {
        up = mid;
      } else {
        l = mid + 1;
      }
    }
    return up;
  }
};

// The table form: cost[i * num_ranks + d - 1] is sequence i alone on d ranks; groups add up.
struct TableModel {
  const int64_t* len;
  Index n;
  Index num_ranks;
  int64_t mem;
  const double* cost;
  mutable std::vector<double> env;  // solve()'s table, reused
  static constexpr bool kThreadSafe = false;  // solve() writes env

  double alone(Index i, Index d) const { return cost[i * num_ranks + d - 1]; }
  double after(const Acc& a, Index i, Index d) const { return a.t + alone(i, d); }
  void add(Acc& a, Index i, Index d) const {
    a.t += alone(i, d);
    a.tokens += len[i];
    ++a.count;
  }
  int regime(const Acc&, Index) const { return 0; }
  double least_increase(Index i, int, Index d) const { return alone(i, d); }
  static bool beyond(double t, double inc, double best) { return t + inc > best; }  // exact: t + x grows with t

  // Sums in index order, as group_times; then the threshold search on their running minima.
  void solve(Index g, Candidate& c) const {
    std::vector<int64_t> tokens(g, 0);
    for (Index i = 0; i < n; ++i) tokens[c.group_of[i]] += len[i];
    std::vector<Index> dmin(g), hi(g);
    Index total = 0;
    for (Index k = 0; k < g; ++k) total += dmin[k] = min_degree(tokens[k], mem);
    c.degree.clear();
    c.makespan = kInf;
    if (total > num_ranks) return;
    const Index w = num_ranks + 1;
    env.assign(static_cast<size_t>(g) * w, 0.0);
    for (Index i = 0; i < n; ++i) {  // whole rows: in index order per group, as group_times
      double* row = env.data() + c.group_of[i] * w + 1;
      const double* t = cost + i * num_ranks;
      for (Index d = 0; d < num_ranks; ++d) row[d] += t[d];
    }
    for (Index k = 0; k < g; ++k) {
      hi[k] = num_ranks - (total - dmin[k]);
      for (Index d = dmin[k] + 1; d <= hi[k]; ++d) env[k * w + d] = std::min(env[k * w + d], env[k * w + d - 1]);
    }
    auto t = [&](Index k, Index d) { return env[k * w + d]; };
    c.degree = threshold_degrees(g, num_ranks, dmin.data(), hi.data(), t);
    if (c.degree.empty()) return;
    c.makespan = 0.0;  // the first degree under the threshold is where the minimum was reached
    for (Index k = 0; k < g; ++k) c.makespan = std::max(c.makespan, t(k, c.degree[k]));
  }
  int64_t solve_work(Index g) const { return (n + g) * num_ranks; }  // the table's sums
  std::vector<double> group_times(const std::vector<Index>& group_of, const std::vector<Index>& degree) const {
    std::vector<double> out(degree.size(), 0.0);
    for (Index i = 0; i < n; ++i) out[group_of[i]] += alone(i, degree[group_of[i]]);
    return out;
  }
  double static_alone(Index c, Index) const {
    double worst = 0.0;
    for (Index i = 0; i < n; ++i) worst = std::max(worst, alone(i, c));
    return worst;
  }
  Acc totals() const { return Acc{}; }
  // The slowest sequence alone on c ranks, or the work of all of them over the groups.
  double static_bound(Index c, Index, const Acc&) const {
    double total = 0.0;
    for (Index i = 0; i < n; ++i) total += alone(i, c);
    return std::max(static_alone(c, 0), total / static_cast<double>(num_ranks / c));
  }
  // max(the slowest sequence on its best degree, sum_i min_d d * t_i(d) / N).
  double lower_bound(Index) const {
    double single = 0.0, total = 0.0;
    for (Index i = 0; i < n; ++i) {
      double best = kInf, work = kInf;
      for (Index d = min_degree(len[i], mem); d <= num_ranks; ++d) {
        best = std::min(best, alone(i, d));
        work = std::min(work, static_cast<double>(d) * alone(i, d));
      }
      single = std::max(single, best);
      total += work;
    }
    return std::max(single, total / static_cast<double>(num_ranks));
  }
  Index fewest_ranks(Index i, double target) const {
    const Index lo = min_degree(len[i], mem);
    Index best = lo;
    for (Index d = lo; d <= num_ranks; ++d) {
      if (alone(i, d) <= target) return d;
      if (alone(i, d) < alone(i, best)) best = d;
    }
    return best;
  }
};

}  // namespace dhp_detail
}  // namespace mmb
