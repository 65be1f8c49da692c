// Dynamic context-parallel groups (DHP section 4.3), and better.
//
// The paper: best-fit-decreasing (BFD) packs sequences into memory-full atomic groups, then a 2-D
// DP gives each group a degree (O(g N^2)). Memory-full groups can be badly balanced in time, so we
// keep the paper's candidate and add the static uniform degrees c (N / c groups of c ranks,
// sequences longest-first to the group that stays fastest) and "mixed" ones (every sequence too
// slow or too large for one rank alone on the fewest ranks that fix it, the rest spread over
// degree-1 groups; the target time searched between the best makespan found and the lower bound).
// Candidates get optimal degrees (an exact threshold search, the same optimum as the DP), the best
// ones a few rounds of regrouping for the degrees found (spare ranks become new groups). The static
// schedules make the result never worse than the best static uniform CP degree; the paper's
// candidate makes it never worse than the paper.
//
// One search, two forms of cost: the closed form of CpCost (a group's time from its sums of l and
// l^2), and a table of every sequence's time alone on every degree, a group's time being the sum
// over its sequences (a vectorized user cost).
//
// Size (n sequences, N ranks): a static degree with N / c >= n groups puts every sequence alone,
// so its makespan is the slowest sequence alone and its optimal-degree version is the one
// "every sequence alone" candidate. The other static degrees are filled greedily: all of them
// while n * count <= kStaticBudget, else the largest degree of every distinct group count N / c,
// thinned geometrically to kStaticBudget / n when even those are too many; beyond kStaticExhaustive
// sequence placements they are filled in ascending order of a lower bound on their makespan, and
// the sweep stops at the first degree whose bound cannot beat the best found. All their groupings get
// optimal degrees while the work stays within kStaticSolves, else the best ones (by static
// makespan) that fit in it, at least kStaticStarts. The
// greedy fill scans up to kScanGroups groups; beyond, it keeps the groups ordered by time (per
// degree, and per regime: ring- or attention-bound) and stops at the first whose time plus the
// least the sequence can add is above the best found, groups in one state counting once. Closed-
// form times are quasi-convex in d (a decreasing compute term, a convex ring term), so optimal
// degrees search each group's best degree instead of tabulating all N. From kParallelWork
// sequences x ranks (closed form only) independent fills, solves and searches run two at a time,
// on the caller's thread and the helper thread (helper_thread.hpp); every decision is taken in
// the order one thread would take it, so the result does not depend on the threads.
#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <limits>
#include <set>
#include <tuple>
#include <utility>

#include "cp_costs.hpp"
#include "helper_thread.hpp"
#include "schedulers.hpp"

namespace mmb {

using namespace dhp_detail;

namespace {

// A non-empty group in the greedy's ordered set. Groups with equal time, sums, tokens and degree
// are interchangeable: the lowest index stands for them all.
struct Key {
  double t, s1, s2;
  int64_t tokens;
  Index d, k;
  bool operator<(const Key& o) const {
    return std::tie(t, s1, s2, tokens, d, k) < std::tie(o.t, o.s1, o.s2, o.tokens, o.d, o.k);
  }
};

// Longest first, each sequence to the group whose time after adding it is smallest (ties: lowest
// group), among the groups with memory left. Returns false if a sequence fits nowhere.
template <class M>
bool greedy_assign(const M& m, const std::vector<Index>& order, const std::vector<Index>& degree,
                   std::vector<Index>& group_of, std::vector<Acc>* out) {
  const Index g = static_cast<Index>(degree.size());
  const int64_t mem = m.mem;
  std::vector<Acc> acc(g);
  if (g <= kScanGroups) {
    for (Index i : order) {
      const int64_t l = m.len[i];
      Index best = -1;
      double best_t = kInf;
      for (Index k = 0; k < g; ++k) {
        if (acc[k].tokens + l > degree[k] * mem) continue;
        const double t = m.after(acc[k], i, degree[k]);
        if (t < best_t) {
          best_t = t;
          best = k;
        }
      }
      if (best < 0) return false;
      m.add(acc[best], i, degree[best]);
      group_of[i] = best;
    }
  } else {
    // Empty groups of one degree are taken in index order: only the first of each degree counts.
    std::vector<Index> distinct(degree);
    std::sort(distinct.begin(), distinct.end());
    distinct.erase(std::unique(distinct.begin(), distinct.end()), distinct.end());
    auto slot = [&](Index d) { return std::lower_bound(distinct.begin(), distinct.end(), d) - distinct.begin(); };
    std::vector<std::vector<Index>> empty(distinct.size());
    for (Index k = 0; k < g; ++k) empty[slot(degree[k])].push_back(k);
    std::vector<size_t> next(distinct.size(), 0);
    // non-empty groups by degree and regime, each set with its own bound
    std::vector<std::set<Key>> busy(2 * distinct.size());
    std::vector<std::set<Key>::iterator> where(g);  // each non-empty group's place in its set
    // per set its fastest time (inf when empty) and its groups' token capacity, side by side, so
    // the sets that cannot hold the best group are passed over without touching their nodes
    std::vector<double> fastest(busy.size(), kInf);
    std::vector<int64_t> cap(busy.size());
    for (size_t j = 0; j < busy.size(); ++j) cap[j] = distinct[j / 2] * mem;
    auto refresh = [&](size_t j) { fastest[j] = busy[j].empty() ? kInf : busy[j].begin()->t; };
    auto key = [&](Index k) { return Key{acc[k].t, acc[k].s1, acc[k].s2, acc[k].tokens, degree[k], k}; };
    auto same = [](const Key& a, const Key& b) {
      return a.t == b.t && a.s1 == b.s1 && a.s2 == b.s2 && a.tokens == b.tokens && a.d == b.d;
    };
    for (Index i : order) {
      const int64_t l = m.len[i];
      Index best = -1;
      double best_t = kInf;
      auto consider = [&](Index k, double t) {
        if (t < best_t || (t == best_t && k < best)) {
          best_t = t;
          best = k;
        }
      };
      for (size_t j = 0; j < distinct.size(); ++j)
        if (next[j] < empty[j].size() && l <= distinct[j] * mem) consider(empty[j][next[j]], m.alone(i, distinct[j]));
      for (size_t j = 0; j < busy.size(); ++j) {
        // empty, too small, or its fastest group already too slow: beyond(t, inc, best_t) for
        // every inc >= 0
        if (fastest[j] * (1.0 - 1e-12) > best_t || l > cap[j]) continue;
        const auto& set = busy[j];
        const Index d = distinct[j / 2];
        const double inc = m.least_increase(i, static_cast<int>(j % 2), d);
        for (auto it = set.begin(); it != set.end();) {
          if (M::beyond(it->t, inc, best_t)) break;
          if (it->tokens + l <= d * mem) consider(it->k, m.after(acc[it->k], i, d));
          auto nx = std::next(it);
          if (nx != set.end() && same(*nx, *it)) {  // skip the group's twins at once
            Key past = *it;
            past.k = std::numeric_limits<Index>::max();
            nx = set.upper_bound(past);
          }
          it = nx;
        }
      }
      if (best < 0) return false;
      const size_t j = 2 * static_cast<size_t>(slot(degree[best]));
      // the group's node moves to its new place: no search to take it out, no allocation
      std::set<Key>::node_type node;
      if (acc[best].count == 0) {
        ++next[j / 2];
      } else {
        const size_t from = j + m.regime(acc[best], degree[best]);
        node = busy[from].extract(where[best]);
        refresh(from);
      }
      m.add(acc[best], i, degree[best]);
      const size_t to = j + m.regime(acc[best], degree[best]);
      auto& into = busy[to];
      if (node) {
        node.value() = key(best);
        where[best] = into.insert(std::move(node)).position;
      } else {
        where[best] = into.insert(key(best)).first;
      }
      refresh(to);
      group_of[i] = best;
    }
  }
  if (out) *out = std::move(acc);
  return true;
}

// Renumber groups 0..g'-1 dropping empty ones (first appearance keeps it stable); returns g'.
Index compact(std::vector<Index>& group_of) {
  Index g = 0;
  for (Index k : group_of) g = std::max(g, k + 1);
  std::vector<Index> map(g, -1);
  Index next = 0;
  for (Index& k : group_of) {
    if (map[k] < 0) map[k] = next++;
    k = map[k];
  }
  return next;
}

// Regroup for the degrees found (spare ranks as new degree-1 groups), re-solve the degrees; keep
// going while the makespan improves.
template <class M>
void improve(const M& m, const std::vector<Index>& order, Index rounds, Candidate& best) {
  Candidate cur = best;
  for (Index r = 0; r < rounds && !cur.degree.empty(); ++r) {
    std::vector<Index> degree = cur.degree;
    Index used = 0;
    for (Index d : degree) used += d;
    for (Index s = used; s < m.num_ranks; ++s) degree.push_back(1);
    Candidate next;
    next.group_of.assign(m.n, 0);
    next.method = best.method;
    if (!greedy_assign(m, order, degree, next.group_of, nullptr)) return;
    m.solve(compact(next.group_of), next);
    if (!(next.makespan < cur.makespan)) return;
    cur = std::move(next);
    if (cur.makespan < best.makespan) best = cur;
  }
}

// Sequences whose single time on their fewest ranks exceeds `target` get a group of their own with
// the fewest ranks that bring them under it (memory minimum with target = inf); the rest of the
// ranks become degree-1 groups; then greedy assignment and optimal degrees.
template <class M>
bool mixed_start(const M& m, const std::vector<Index>& order, double target, Candidate& out) {
  std::vector<Index> degree;
  Index used = 0;
  for (Index i : order) {
    const Index d = m.fewest_ranks(i, target);
    if (d == 1) break;
    degree.push_back(d);
    used += d;
    if (used > m.num_ranks) return false;
  }
  if (degree.empty()) return false;
  for (Index s = used; s < m.num_ranks; ++s) degree.push_back(1);
  out.group_of.assign(m.n, 0);
  out.method = std::isfinite(target) ? "mixed-time" : "mixed-memory";
  if (!greedy_assign(m, order, degree, out.group_of, nullptr)) return false;
  m.solve(compact(out.group_of), out);
  return std::isfinite(out.makespan);
}

// The static degrees filled greedily: those with fewer groups (N / c) than sequences. All of them
// within the budget, else the largest degree of each group count, thinned geometrically.
std::vector<Index> greedy_static_degrees(Index n, Index num_ranks) {
  std::vector<Index> cs;
  const Index c0 = num_ranks / n + 1;
  if (c0 > num_ranks) return cs;
  if (num_ranks - c0 + 1 <= kStaticBudget / n) {
    for (Index c = c0; c <= num_ranks; ++c) cs.push_back(c);
    return cs;
  }
  for (Index c = c0; c <= num_ranks; c = num_ranks / (num_ranks / c) + 1) cs.push_back(num_ranks / (num_ranks / c));
  const Index most = std::max<Index>(8, kStaticBudget / n);
  if (static_cast<Index>(cs.size()) <= most) return cs;
  std::vector<Index> kept;
  const double ratio =
      std::pow(static_cast<double>(num_ranks) / static_cast<double>(c0), 1.0 / static_cast<double>(most - 1));
  double next = 0.0;
  for (size_t j = 0; j < cs.size(); ++j) {
    if (static_cast<double>(cs[j]) >= next || j + 1 == cs.size()) {
      kept.push_back(cs[j]);
      next = static_cast<double>(cs[j]) * ratio;
    }
  }
  return kept;
}

template <class M>
CpResult schedule(const M& m, Index ranks_per_node, Index max_rounds) {
  CpResult res;
  const Index n = m.n, num_ranks = m.num_ranks;
  if (n == 0) {
    res.rank_offset.assign(1, 0);
    res.method = "empty";
    res.static_makespan = res.paper_makespan = 0.0;
    return res;
  }
  const auto order = order_by_length_desc(m.len, n);
  const Index longest = order[0];
  std::vector<Candidate> starts;
  // large plans split independent fills and solves over two threads (helper_thread.hpp); the
  // result is the same as on one
  const bool par = M::kThreadSafe && static_cast<int64_t>(n) * num_ranks >= kParallelWork;

  // Two starts that need nothing else (with two threads, beside the static sweep below): the
  // paper's, BFD atomic groups + optimal degrees; and "mixed, by memory", long sequences alone on
  // their minimum degree
  Candidate paper, by_memory;
  bool by_memory_ok = false;
  auto other_starts = [&] {
    std::vector<Index> dmin;
    paper.group_of = bfd_groups(m.len, n, m.mem, dmin);
    paper.method = "paper";
    m.solve(static_cast<Index>(dmin.size()), paper);
    by_memory_ok = mixed_start(m, order, kInf, by_memory);
  };
  std::vector<Candidate> statics;  // the static starts, in the order they are made
  auto note_static = [&](double ms, Index c) {
    // ties: the smaller degree, whatever order the sweep fills them in
    if (res.static_makespan < 0 || ms < res.static_makespan || (ms == res.static_makespan && c < res.static_degree)) {
      res.static_makespan = ms;
      res.static_degree = c;
    }
  };
  // static degrees with at least as many groups as sequences: every sequence alone
  for (Index c = 1; c <= num_ranks && num_ranks / c >= n; ++c)
    if (m.len[longest] <= c * m.mem) note_static(m.static_alone(c, longest), c);
  // the other static degrees greedily. A small sweep (n x degrees <= kStaticExhaustive) fills every
  // degree; a larger one the most promising first (ascending lower bound on their makespan) and
  // stops at the first whose bound is not below the best static makespan found: no later degree
  // can beat it. The groupings filled get optimal degrees (all of them while the solves' work
  // stays within kStaticSolves, else the best static makespans that fit in it)
  std::vector<std::pair<double, std::vector<Index>>> kept;
  auto static_sweep = [&] {
    if (n <= num_ranks) {
      Candidate c;
      c.group_of.resize(n);
      for (Index i = 0; i < n; ++i) c.group_of[i] = i;
      c.method = "static+dp";
      m.solve(n, c);
      statics.push_back(std::move(c));
    }
    const auto cs = greedy_static_degrees(n, num_ranks);
    int64_t work = 0;
    for (Index c : cs) work += m.solve_work(std::min(n, num_ranks / c));
    const size_t keep = work <= kStaticSolves
                            ? cs.size()
                            : std::max<size_t>(kStaticStarts, static_cast<size_t>(kStaticSolves / (work / cs.size())));
    const bool prune = n * static_cast<int64_t>(cs.size()) > kStaticExhaustive;
    std::vector<std::pair<double, Index>> by_bound;
    {
      const auto totals = m.totals();
      for (Index c : cs)
        if (m.len[longest] <= c * m.mem) by_bound.push_back({prune ? m.static_bound(c, longest, totals) : 0.0, c});
      std::stable_sort(by_bound.begin(), by_bound.end(),
                       [](const auto& a, const auto& b) { return a.first < b.first; });
    }
    for (const auto& [bound, c] : by_bound) {
      if (prune && res.static_makespan >= 0 && bound * (1.0 - 1e-9) >= res.static_makespan) break;
      std::vector<Index> group_of(n);
      std::vector<Acc> acc;
      if (!greedy_assign(m, order, std::vector<Index>(num_ranks / c, c), group_of, &acc)) continue;
      double ms = 0.0;
      for (const Acc& a : acc) ms = std::max(ms, a.t);
      note_static(ms, c);
      if (kept.size() < keep) {
        kept.emplace_back(ms, std::move(group_of));
      } else {
        auto worst =
            std::max_element(kept.begin(), kept.end(), [](const auto& a, const auto& b) { return a.first < b.first; });
        if (ms < worst->first) *worst = {ms, std::move(group_of)};
      }
    }
    for (auto& [ms, group_of] : kept) {
      Candidate c;
      c.group_of = std::move(group_of);
      c.method = "static+dp";
      m.solve(compact(c.group_of), c);
      statics.push_back(std::move(c));
    }
  };
  if (par) {
    run_beside(other_starts, static_sweep);
  } else {
    other_starts();
    static_sweep();
  }
  res.paper_makespan = std::isfinite(paper.makespan) ? paper.makespan : -1.0;
  starts.push_back(std::move(paper));
  for (auto& c : statics) starts.push_back(std::move(c));
  if (by_memory_ok) starts.push_back(std::move(by_memory));
  Candidate best;  // the best start (the first of equal ones)
  for (const Candidate& c : starts)
    if (c.makespan < best.makespan) best = c;
  // mixed, by time: sequences slower than a target alone get groups of their own (mixed_start);
  // a target is met when the start beats the best makespan, and it then lands near the target. A
  // search between the best makespan and `lo` (at first the lower bound), two targets a round: a
  // tenth and half of the way down at first (then also the best makespan itself if both fail),
  // then two thirds and a third. The better success is kept; a failure of the lower target raises
  // `lo` to it; a round without success ends the search. The two targets of a round run on two
  // threads for large plans; the result is the same either way.
  const double lb = m.lower_bound(longest);
  res.lower_bound = lb;
  double lo = lb;
  auto reach = [&](double target, Candidate& c) {
    return mixed_start(m, order, target, c) && c.makespan < best.makespan;
  };
  for (Index r = 0; r < kMixedRounds && std::isfinite(best.makespan); ++r) {
    const double hi = best.makespan;
    if (!(hi > lo * (1.0 + kMixedGap))) break;  // as good as the search can tell
    const double t1 = r == 0 ? 0.5 * (hi + lo) : hi - (hi - lo) / 3.0;
    const double t2 = r == 0 ? lo + 0.1 * (hi - lo) : hi - 2.0 * (hi - lo) / 3.0;
    Candidate c1, c2;
    bool ok1 = false, ok2 = false;
    auto try1 = [&] { ok1 = reach(t1, c1); };
    auto try2 = [&] { ok2 = reach(t2, c2); };
    if (par) {
      run_beside(try2, try1);
    } else {
      try1();
      try2();
    }
    if (!ok1 && !ok2) {
      Candidate c;
      if (r == 0 && reach(hi, c)) {  // as the first rounds of the search
        best = std::move(c);
        continue;
      }
      break;
    }
    if (!ok2) lo = std::max(lo, t2);
    best = std::move(ok2 && (!ok1 || c2.makespan <= c1.makespan) ? c2 : c1);
  }
  // regroup the three best starts for their degrees, those within kImproveWithin of the best
  // (regrouping never gained that much). Not the search's best: it is a grouping made for degrees
  // of its own already, and regrouping it changed nothing in any of 106 plans of bench cp's data.
  std::vector<const Candidate*> ranked;
  for (const Candidate& c : starts) ranked.push_back(&c);
  std::stable_sort(ranked.begin(), ranked.end(),
                   [](const Candidate* a, const Candidate* b) { return a->makespan < b->makespan; });
  std::vector<Candidate> top;
  for (const Candidate* c : ranked) {
    if (top.size() == 3 || !(c->makespan <= best.makespan * kImproveWithin)) break;
    top.push_back(*c);
  }
  {
    // each chain on whichever thread is free next: chains do not depend on each other
    std::atomic<size_t> next{0};
    auto chains = [&] {
      for (size_t j; (j = next.fetch_add(1)) < top.size();) improve(m, order, max_rounds, top[j]);
    };
    if (par && top.size() > 1) {
      run_beside(chains, chains);
    } else {
      chains();
    }
  }
  for (Candidate& c : top)
    if (c.makespan < best.makespan) best = std::move(c);
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
  res.time = m.group_times(res.group_of, res.degree);
  res.makespan = 0.0;
  for (double t : res.time) res.makespan = std::max(res.makespan, t);
  res.method = best.method;
  layout_ranks(res.degree, num_ranks, ranks_per_node, res.rank_offset, res.ranks);
  return res;
}

}  // namespace

CpResult cp_schedule(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                     Index ranks_per_node, Index max_rounds, const double* extra) {
  return schedule(CpModel{lengths, n, num_ranks, mem, cost, extra}, ranks_per_node, max_rounds);
}

CpResult cp_schedule_table(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const double* cost,
                           Index ranks_per_node, Index max_rounds) {
  return schedule(TableModel{lengths, n, num_ranks, mem, cost, {}}, ranks_per_node, max_rounds);
}

std::vector<Index> cp_static_groups(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                                    Index degree, double* makespan, const double* extra) {
  const CpModel m{lengths, n, num_ranks, mem, cost, extra};
  std::vector<Index> group_of(n);
  std::vector<Acc> acc;
  if (!greedy_assign(m, order_by_length_desc(lengths, n), std::vector<Index>(num_ranks / degree, degree), group_of,
                     &acc))
    return {};
  *makespan = 0.0;
  for (const Acc& a : acc) *makespan = std::max(*makespan, a.t);
  return group_of;
}

}  // namespace mmb
