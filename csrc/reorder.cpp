// 1F1B pipeline simulation and microbatch reordering (DistTrain section 6.1-6.2, MMScale section 5.1-5.2).
//
// Intra-microbatch: the samples of a global batch are split over DP groups in equal-count blocks
// (what a data loader does with the reordered batch). The paper's algorithm 2 sorts ascending and
// gives each sample to the least-loaded group, ignoring the counts; we partition with the counts
// (longest first to the least-loaded group with a free slot, then swaps out of the largest group).
// Inter-microbatch: the order of a group's microbatches through a 1F1B pipeline. The paper's
// algorithm 3 puts the smallest first, the p-1 smallest last and fills each pipeline interval with
// the microbatch that matches it; we start from the best of that, the original and sorted orders,
// and improve by simulated swaps and moves, so the result never simulates slower than either.
#include <algorithm>
#include <cmath>
#include <limits>
#include <memory>
#include <numeric>
#include <queue>
#include <utility>

#include "schedulers.hpp"

namespace mmb {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();
constexpr Index kPartners = 8;  // groups a swap out of the largest group is tried with

// One op of the 1F1B schedule: stage, microbatch position, forward or backward.
struct Op {
  int32_t stage;
  int32_t pos;
  bool fwd;
};

// Op k on stage s: p-1-s warm-up forwards, then forward/backward pairs, then the cool-down
// backwards.
void op_at(Index s, Index k, Index l, Index p, bool& fwd, Index& pos) {
  const Index w = std::min(p - 1 - s, l);
  if (k < w) {
    fwd = true;
    pos = k;
    return;
  }
  const Index j = k - w, steady = l - w;
  if (j < 2 * steady) {
    fwd = j % 2 == 0;
    pos = fwd ? w + j / 2 : j / 2;
    return;
  }
  fwd = false;
  pos = steady + (j - 2 * steady);
}

// The schedule of (l, p) as one list of ops in an order that respects every dependency, so a
// simulation is one pass over it (the order depends on the shape only, not on the times).
class Schedule {
 public:
  Schedule(Index l, Index p) : l_(l), p_(p) {
    std::vector<Index> next(p, 0);
    std::vector<char> fdone(l * p, 0), bdone(l * p, 0);
    const Index total = 2 * l * p;
    ops_.reserve(total);
    bool up = true;
    while (static_cast<Index>(ops_.size()) < total) {
      for (Index t = 0; t < p; ++t) {
        const Index s = up ? t : p - 1 - t;
        while (next[s] < 2 * l) {
          bool f;
          Index pos;
          op_at(s, next[s], l, p, f, pos);
          const bool ready = f ? (s == 0 || fdone[pos * p + s - 1])
                               : (s == p - 1 ? fdone[pos * p + s] : bdone[pos * p + s + 1]);
          if (!ready) break;
          (f ? fdone : bdone)[pos * p + s] = 1;
          ops_.push_back({static_cast<int32_t>(s), static_cast<int32_t>(pos), f});
          ++next[s];
        }
      }
      up = !up;
    }
    fend_.resize(l * p);
    bend_.resize(l * p);
    free_.resize(p);
  }

  // Makespan with microbatch order[pos] at position pos (order == nullptr: identity).
  double run(const double* fwd, const double* bwd, const Index* order, double* fstart = nullptr,
             double* bstart = nullptr) {
    std::fill(free_.begin(), free_.end(), 0.0);
    const Index p = p_;
    for (const Op& op : ops_) {
      const Index s = op.stage, pos = op.pos;
      const Index row = (order ? order[pos] : pos) * p + s;
      double start;
      if (op.fwd) {
        start = s == 0 ? free_[s] : std::max(free_[s], fend_[pos * p + s - 1]);
        if (fstart) fstart[pos * p + s] = start;
        free_[s] = fend_[pos * p + s] = start + fwd[row];
      } else {
        start = std::max(free_[s], s == p - 1 ? fend_[pos * p + s] : bend_[pos * p + s + 1]);
        if (bstart) bstart[pos * p + s] = start;
        free_[s] = bend_[pos * p + s] = start + bwd[row];
      }
    }
    double ms = 0.0;
    for (double f : free_) ms = std::max(ms, f);
    return ms;
  }
  double fend(Index pos, Index s) const { return fend_[pos * p_ + s]; }
  double bend(Index pos, Index s) const { return bend_[pos * p_ + s]; }

 private:
  Index l_, p_;
  std::vector<Op> ops_;
  std::vector<double> fend_, bend_, free_;
};

// Schedules by shape, built once per call and shared by every group of that shape.
class ScheduleCache {
 public:
  Schedule& get(Index l, Index p) {
    for (auto& e : cache_)
      if (e.first.first == l && e.first.second == p) return *e.second;
    cache_.emplace_back(std::make_pair(l, p), std::make_unique<Schedule>(l, p));
    return *cache_.back().second;
  }

 private:
  std::vector<std::pair<std::pair<Index, Index>, std::unique_ptr<Schedule>>> cache_;
};

// Items sorted by w ascending (ties by index).
std::vector<Index> by_weight(const double* w, Index n) {
  std::vector<Index> idx(n);
  std::iota(idx.begin(), idx.end(), Index{0});
  std::stable_sort(idx.begin(), idx.end(), [&](Index a, Index b) { return w[a] < w[b]; });
  return idx;
}

// SELECTCLOSEST(mb, k, target): k unused microbatches whose first-stage forward times sum closest
// to target, greedily (each pick aims at the remaining target over the remaining picks).
std::vector<Index> select_closest(const std::vector<double>& size, std::vector<char>& used, Index k,
                                  double target) {
  std::vector<Index> out;
  double left = target;
  for (Index j = 0; j < k; ++j) {
    const double aim = left / static_cast<double>(k - j);
    Index best = -1;
    for (Index i = 0; i < static_cast<Index>(size.size()); ++i)
      if (!used[i] && (best < 0 || std::abs(size[i] - aim) < std::abs(size[best] - aim))) best = i;
    if (best < 0) break;
    used[best] = 1;
    out.push_back(best);
    left -= size[best];
  }
  return out;
}

}  // namespace

double simulate_1f1b(const double* fwd, const double* bwd, Index l, Index p, double* fstart, double* bstart) {
  if (l == 0 || p == 0) return 0.0;
  Schedule sch(l, p);
  return sch.run(fwd, bwd, nullptr, fstart, bstart);
}

std::vector<Index> balanced_count_groups(const double* w, Index n, Index m, Index max_iters) {
  std::vector<Index> group(n, 0);
  if (n == 0) return group;
  std::vector<Index> cap(m, n / m);
  for (Index k = 0; k < n % m; ++k) ++cap[k];
  std::vector<double> load(m, 0.0);
  std::vector<Index> cnt(m, 0);
  using Entry = std::pair<double, Index>;
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (Index k = 0; k < m; ++k)
    if (cap[k] > 0) heap.push({0.0, k});
  std::vector<Index> order(n);
  std::iota(order.begin(), order.end(), Index{0});
  std::stable_sort(order.begin(), order.end(), [&](Index a, Index b) { return w[a] > w[b]; });
  for (Index i : order) {
    const Index k = heap.top().second;
    heap.pop();
    group[i] = k;
    load[k] += w[i];
    if (++cnt[k] < cap[k]) heap.push({load[k], k});
  }
  if (max_iters <= 0) return group;
  // swaps out of the largest group: the pair whose difference is closest to half the gap
  std::vector<std::vector<Index>> items(m);
  for (Index i : order) items[group[i]].push_back(i);
  auto resort = [&](Index k) {
    std::stable_sort(items[k].begin(), items[k].end(), [&](Index a, Index b) { return w[a] < w[b]; });
  };
  for (Index k = 0; k < m; ++k) resort(k);
  std::vector<Index> by_load(m);
  for (Index it = 0; it < max_iters; ++it) {
    Index top = 0;
    for (Index k = 1; k < m; ++k)
      if (load[k] > load[top]) top = k;
    double best_max = load[top];
    Index ba = -1, bb = -1, bo = -1;
    // Partners: the kPartners lightest groups, by load ascending. A swap with o leaves
    // max(L_top - d, L_o + d) >= (L_top + L_o) / 2, so once that bound reaches the best found no
    // heavier partner can do better.
    std::iota(by_load.begin(), by_load.end(), Index{0});
    const Index take = std::min<Index>(kPartners, m);
    std::partial_sort(by_load.begin(), by_load.begin() + take, by_load.end(), [&](Index a, Index b) {
      return load[a] < load[b] || (load[a] == load[b] && a < b);
    });
    for (Index j = 0; j < take; ++j) {
      const Index o = by_load[j];
      if (0.5 * (load[top] + load[o]) >= best_max) break;
      if (o == top || items[o].empty()) continue;
      const double gap = load[top] - load[o];
      if (!(gap > 0)) continue;
      const auto& io = items[o];
      for (Index a : items[top]) {
        // want w[b] close to w[a] - gap / 2, with 0 < w[a] - w[b] < gap
        const double aim = w[a] - gap / 2;
        auto pos = std::lower_bound(io.begin(), io.end(), aim, [&](Index x, double v) { return w[x] < v; });
        for (int side = 0; side < 2; ++side) {
          if (side == 0 && pos == io.end()) continue;
          if (side == 1 && pos == io.begin()) continue;
          const Index b = side == 0 ? *pos : *(pos - 1);
          const double d = w[a] - w[b];
          if (!(d > 0 && d < gap)) continue;
          const double nm = std::max(load[top] - d, load[o] + d);
          if (nm < best_max) {
            best_max = nm;
            ba = a;
            bb = b;
            bo = o;
          }
        }
      }
    }
    if (ba < 0) break;
    const double d = w[ba] - w[bb];
    load[top] -= d;
    load[bo] += d;
    group[ba] = bo;
    group[bb] = top;
    std::replace(items[top].begin(), items[top].end(), ba, bb);
    std::replace(items[bo].begin(), items[bo].end(), bb, ba);
    resort(top);
    resort(bo);
  }
  return group;
}

std::vector<Index> paper_intra_order(const double* w, Index n, Index m) {
  const auto order = by_weight(w, n);  // ascending, as algorithm 2 line 3
  std::vector<std::vector<Index>> groups(m);
  using Entry = std::pair<double, Index>;  // (load, group): the least load, ties the lowest group
  std::priority_queue<Entry, std::vector<Entry>, std::greater<Entry>> heap;
  for (Index k = 0; k < m; ++k) heap.push({0.0, k});
  for (Index i : order) {
    const auto [load, k] = heap.top();
    heap.pop();
    groups[k].push_back(i);
    heap.push({load + w[i], k});
  }
  std::vector<Index> out;
  out.reserve(n);
  for (const auto& g : groups) out.insert(out.end(), g.begin(), g.end());
  return out;
}

namespace {

std::vector<Index> paper_inter_impl(const double* fwd, const double* bwd, Index l, Index p, ScheduleCache& cache) {
  std::vector<Index> ident(l);
  std::iota(ident.begin(), ident.end(), Index{0});
  if (l == 0 || p <= 1) return ident;
  std::vector<double> size(l);  // forward time on the first stage
  for (Index i = 0; i < l; ++i) size[i] = fwd[i * p];
  std::vector<char> used(l, 0);
  const auto asc = by_weight(size.data(), l);
  std::vector<Index> ret{asc[0]};
  used[asc[0]] = 1;
  std::vector<Index> rear;
  for (Index j = 1; j < l && static_cast<Index>(rear.size()) < p - 1; ++j) {
    rear.push_back(asc[j]);
    used[asc[j]] = 1;
  }
  std::reverse(rear.begin(), rear.end());  // the smallest last
  // Interval i is bounded by ops of the microbatches placed so far only, so it is read from the
  // schedule of just those (the same ops, in the same order, as in the full schedule).
  const Index filler = l - 1 - static_cast<Index>(rear.size());
  for (Index i = 1; static_cast<Index>(ret.size()) < 1 + filler; ++i) {
    const Index q = static_cast<Index>(ret.size());
    Schedule& sch = cache.get(q, p);
    sch.run(fwd, bwd, ret.data());
    const double interval = i == 1 ? sch.bend(0, 1) - sch.fend(0, 0) : sch.bend(i - 1, 1) - sch.bend(i - 2, 0);
    const Index k = i == 1 ? std::min(p - 1, filler) : 1;
    const auto cur = select_closest(size, used, k, std::max(0.0, interval));
    ret.insert(ret.end(), cur.begin(), cur.end());
  }
  ret.insert(ret.end(), rear.begin(), rear.end());
  return ret;
}

}  // namespace

std::vector<Index> paper_inter_order(const double* fwd, const double* bwd, Index l, Index p) {
  ScheduleCache cache;
  return paper_inter_impl(fwd, bwd, l, p, cache);
}

namespace {

// The best seed order of one group: original, ascending, the smallest first with the p-1 next
// smallest last and the rest descending, and (if asked) the paper's. Returns its time.
double seed_order(const double* fwd, const double* bwd, Index l, Index p, bool paper_seed, ScheduleCache& cache,
                  std::vector<Index>& best) {
  std::vector<Index> ident(l);
  std::iota(ident.begin(), ident.end(), Index{0});
  best = ident;
  if (l <= 1 || p == 0) return l == 0 ? 0.0 : cache.get(l, p).run(fwd, bwd, nullptr);
  Schedule& sch = cache.get(l, p);
  std::vector<double> tot(l, 0.0);
  for (Index i = 0; i < l; ++i)
    for (Index s = 0; s < p; ++s) tot[i] += fwd[i * p + s] + bwd[i * p + s];
  const auto asc = by_weight(tot.data(), l);
  std::vector<std::vector<Index>> seeds{ident, asc};
  {
    std::vector<Index> s{asc[0]};
    const Index tail = std::min(p - 1, l - 1);
    for (Index j = l - 1; j > tail; --j) s.push_back(asc[j]);
    for (Index j = tail; j >= 1; --j) s.push_back(asc[j]);
    seeds.push_back(s);
  }
  if (paper_seed) seeds.push_back(paper_inter_impl(fwd, bwd, l, p, cache));
  double best_t = kInf;
  for (const auto& s : seeds) {
    const double t = sch.run(fwd, bwd, s.data());
    if (t < best_t) {
      best_t = t;
      best = s;
    }
  }
  return best_t;
}

// First-improvement local search on `cur` (time `cur_t`): adjacent swaps, then moving one
// microbatch to the front; at most max_evals simulations. Returns the new time.
double local_search(const double* fwd, const double* bwd, Index l, Index p, Index max_evals, ScheduleCache& cache,
                    std::vector<Index>& cur, double cur_t) {
  if (l <= 1 || p <= 1) return cur_t;  // no pipeline: every order takes the same time
  Schedule& sch = cache.get(l, p);
  Index evals = 0;
  bool improved = true;
  std::vector<Index> cand;
  while (improved && evals < max_evals) {
    improved = false;
    for (Index i = 0; i + 1 < l && evals < max_evals; ++i) {
      std::swap(cur[i], cur[i + 1]);
      const double t = sch.run(fwd, bwd, cur.data());
      ++evals;
      if (t < cur_t) {
        cur_t = t;
        improved = true;
      } else {
        std::swap(cur[i], cur[i + 1]);
      }
    }
    for (Index i = 1; i < l && evals < max_evals; ++i) {
      cand = cur;
      std::rotate(cand.begin(), cand.begin() + i, cand.begin() + i + 1);
      const double t = sch.run(fwd, bwd, cand.data());
      ++evals;
      if (t < cur_t) {
        cur_t = t;
        cur.swap(cand);
        improved = true;
      }
    }
  }
  return cur_t;
}

}  // namespace

std::vector<Index> inter_order(const double* fwd, const double* bwd, Index l, Index p, Index max_evals) {
  ScheduleCache cache;
  std::vector<Index> order;
  const double t = seed_order(fwd, bwd, l, p, true, cache, order);
  local_search(fwd, bwd, l, p, max_evals, cache, order, t);
  return order;
}

std::vector<Index> reorder_blocks(const double* fwd, const double* bwd, Index p, const Index* order,
                                  const Index* offsets, Index groups, int method, Index max_evals,
                                  std::vector<double>* times) {
  ScheduleCache cache;
  std::vector<Index> out(order, order + offsets[groups]);
  std::vector<std::vector<double>> f(groups), b(groups);
  std::vector<std::vector<Index>> local(groups);
  std::vector<double> time(groups, 0.0);
  for (Index k = 0; k < groups; ++k) {
    const Index* idx = out.data() + offsets[k];
    const Index cnt = offsets[k + 1] - offsets[k];
    f[k].resize(static_cast<size_t>(cnt) * p);
    b[k].resize(static_cast<size_t>(cnt) * p);
    for (Index q = 0; q < cnt; ++q)
      for (Index s = 0; s < p; ++s) {
        f[k][q * p + s] = fwd[idx[q] * p + s];
        b[k][q * p + s] = bwd[idx[q] * p + s];
      }
    if (method == 1) {
      local[k] = paper_inter_impl(f[k].data(), b[k].data(), cnt, p, cache);
    } else {
      time[k] = seed_order(f[k].data(), b[k].data(), cnt, p, method == 0, cache, local[k]);
    }
  }
  if (method != 1) {
    // The makespan is the slowest group's time: search the slowest group, then the new slowest,
    // until the slowest has been searched already (it cannot be improved further).
    std::vector<char> searched(groups, 0);
    for (;;) {
      Index top = -1;
      for (Index k = 0; k < groups; ++k)
        if (top < 0 || time[k] > time[top]) top = k;
      if (top < 0 || searched[top]) break;
      searched[top] = 1;
      const Index cnt = offsets[top + 1] - offsets[top];
      time[top] = local_search(f[top].data(), b[top].data(), cnt, p, max_evals, cache, local[top], time[top]);
    }
  }
  for (Index k = 0; k < groups; ++k) {
    Index* idx = out.data() + offsets[k];
    const Index cnt = offsets[k + 1] - offsets[k];
    std::vector<Index> old(idx, idx + cnt);
    for (Index q = 0; q < cnt; ++q) idx[q] = old[local[k][q]];
    if (times && method == 1) time[k] = cnt ? cache.get(cnt, p).run(f[k].data(), b[k].data(), local[k].data()) : 0.0;
  }
  if (times) *times = std::move(time);
  return out;
}

std::vector<double> simulate_blocks(const double* fwd, const double* bwd, Index p, const Index* order,
                                    const Index* offsets, Index groups) {
  ScheduleCache cache;
  std::vector<double> out(groups, 0.0);
  for (Index k = 0; k < groups; ++k) {
    const Index cnt = offsets[k + 1] - offsets[k];
    if (cnt > 0) out[k] = cache.get(cnt, p).run(fwd, bwd, order + offsets[k]);
  }
  return out;
}

}  // namespace mmb
