// Locality-aware post-balancing: reach the balanced makespan while moving as few tokens as
// possible, and move them within the source's node where that suffices.
//
// OrchMLLM (section 5.2.2) balances first and then permutes whole batches across nodes; examples
// land on arbitrary ranks and almost every token crosses the network. Here a rank keeps its own
// examples up to the target makespan T, sheds a near-minimal set above T, and the shed examples
// fill the free capacity below T, best fit, own node first.
//
// Cost: the target comes from the lower bound first (T0 = bound * (1 + tolerance)), so the common
// case needs no plain plan at all; the plain plan (LPT + local search) is computed only if the
// placement at T0 fails. Examples of ranks at or below the target are never touched: all the
// work is on the overloaded ranks' examples (a few percent of all) and on the shed ones.
// Everything runs on flat arrays (one counting sort of the examples by source rank).
#include <algorithm>
#include <cmath>
#include <limits>
#include <queue>
#include <set>
#include <thread>
#include <utility>
#include <vector>

#include "balance.hpp"
#include "csr.hpp"

namespace mmb {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Chooses a near-minimal-sum subset of the k items `desc` (sorted by weight descending, ties by
// index) whose sum is >= excess: the best of (A) the largest items that still fit under the
// excess and then the smallest one that closes it, (B) the single smallest item covering it, and
// (C) the smallest items until covered, minus those no longer needed. Writes it to `out`.
void shed_set(const Index* desc, Index k, const double* w, double excess, std::vector<Index>& out,
              std::vector<Index>& tmp, std::vector<char>& taken) {
  out.clear();
  // A
  taken.assign(k, 0);
  double rem = excess;
  for (Index j = 0; j < k && rem > 0; ++j) {
    if (w[desc[j]] <= rem) out.push_back(desc[j]), taken[j] = 1, rem -= w[desc[j]];
  }
  if (rem > 0) {
    for (Index j = k; j-- > 0;) {
      if (!taken[j] && w[desc[j]] >= rem) {
        out.push_back(desc[j]);
        rem = 0;
        break;
      }
    }
  }
  if (rem > 0) out.assign(desc, desc + k);  // the rank's whole load is below the excess: cannot happen
  double best = 0.0;
  for (Index i : out) best += w[i];
  // B
  for (Index j = k; j-- > 0;) {
    if (w[desc[j]] >= excess) {
      if (w[desc[j]] < best || (w[desc[j]] == best && out.size() > 1)) out.assign(1, desc[j]), best = w[desc[j]];
      break;
    }
  }
  // C
  tmp.clear();
  double s = 0.0;
  for (Index j = k; j-- > 0 && s < excess;) tmp.push_back(desc[j]), s += w[desc[j]];
  for (size_t j = tmp.size(); j-- > 0;) {
    if (s - w[tmp[j]] >= excess) s -= w[tmp[j]], tmp.erase(tmp.begin() + static_cast<std::ptrdiff_t>(j));
  }
  if (s >= excess && s < best) out.swap(tmp);
}

int bit_width(uint64_t x) {
  int b = 0;
  while (x) ++b, x >>= 1;
  return b;
}

// LSD radix sort of words whose significant bits are the low `bits`, 11 bits per pass.
void radix_sort(std::vector<uint64_t>& keys, int bits) {
  constexpr int kDigit = 11;
  constexpr uint64_t kMask = (1u << kDigit) - 1;
  thread_local std::vector<uint64_t> other;
  other.resize(keys.size());
  std::vector<size_t> count(size_t{1} << kDigit);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (uint64_t k : keys) ++count[(k >> shift) & kMask];
    size_t acc = 0;
    for (auto& c : count) {
      const size_t t = c;
      c = acc;
      acc += t;
    }
    for (uint64_t k : keys) other[count[(k >> shift) & kMask]++] = k;
    keys.swap(other);
  }
}

class Placer {
 public:
  // One per thread, reused from call to call (no fresh multi-megabyte buffers, whose page faults
  // would cost as much as the planning). Only the examples of overloaded ranks are ever sorted:
  // with sources in rank-major order (what gather_lengths gives) a rank's examples are a range,
  // otherwise one counting sort groups them.
  void reset(const double* w, const int64_t* lengths, Index n, Index d, Index per, const Index* src) {
    w_ = w, len_ = lengths, n_ = n, d_ = d, per_ = per, src_ = src;
    load0_.assign(d, 0.0);
    rank_major_ = true;
    int64_t mx = 0;
    for (Index i = 0; i < n; ++i) {
      load0_[src[i]] += w[i];
      rank_major_ = rank_major_ && (i == 0 || src[i - 1] <= src[i]);
      mx = std::max(mx, lengths[i]);
    }
    max_len_ = mx;
    if (rank_major_) {
      by_src_.start.assign(d + 1, 0);
      for (Index i = 0; i < n; ++i) ++by_src_.start[src[i] + 1];
      for (Index r = 0; r < d; ++r) by_src_.start[r + 1] += by_src_.start[r];
    } else {
      by_src_.build(src, n, d);
    }
    mark_item_.assign(n, 0);
    node_of_.resize(d);
    for (Index r = 0; r < d; ++r) node_of_[r] = r / per;
  }

  // The examples sampled on rank r, heaviest first (ties by index), into `out`.
  void items_of(Index r, std::vector<Index>& out) { items_of(r, out, keys_); }
  void items_of(Index r, std::vector<Index>& out, std::vector<uint64_t>& keys) const {
    const Index b = by_src_.start[r], e = by_src_.start[r + 1];
    out.resize(e - b);
    for (Index k = b; k < e; ++k) out[k - b] = rank_major_ ? k : by_src_.order[k];
    sort_heavier_first(out, keys);
  }

  const std::vector<double>& source_loads() const { return load0_; }
  const std::vector<double>& loads() const { return load_; }
  const Csr& by_source() const { return by_src_; }
  bool rank_major() const { return rank_major_; }
  const std::vector<Index>& node_of() const { return node_of_; }
  // examples the last placement moved off their source rank
  const std::vector<Index>& moved() const { return moved_; }

  // One placement at target T; ranks above `cut` (<= T) shed down to it first. Returns whether
  // every rank ends at or below T (then `dst` is the plan).
  bool place(double T, double cut, std::vector<Index>& dst) {
    dst.assign(src_, src_ + n_);
    load_ = load0_;
    pool_.clear();
    // 1. every rank above the cut sheds a near-minimal set (its examples, heaviest first)
    moved_.clear();
    shed_all(cut);
    if (pool_.empty()) return true;
    sort_heavier_first(pool_);
    shed_ = pool_;
    // 2. a node that sheds more than it has room for sends the difference off-node, spread over
    //    its shedding ranks; the rest is placed on the node first
    std::vector<Index>& remote = remote_;
    remote.clear();
    if (per_ < d_) {
      split_by_node(T, dst);
      for (Index i : pool_)  // the remote ones, still heaviest first
        if (mark_item_[i]) remote.push_back(i), mark_item_[i] = 0;
    } else {
      remote.swap(pool_);
    }
    // 3. the rest: home if it has room, else best fit on the home node, else best fit anywhere
    build_free_index(T);
    overflow_ = false;
    for (Index i : remote) put(i, T, dst);
    // 4. repair rounds: a rank that overflowed sheds again, the shed examples go elsewhere
    for (int round = 0; overflow_ && round < 16; ++round) {
      overflow_ = false;
      pool_.clear();
      collect_over(T, dst);
      if (pool_.empty()) break;
      sort_heavier_first(pool_);
      for (Index i : pool_) put(i, T, dst);
      shed_.insert(shed_.end(), pool_.begin(), pool_.end());
    }
    for (Index r = 0; r < d_; ++r)
      if (load_[r] > T) return false;
    for (Index i : shed_)
      if (dst[i] != src_[i] && !mark_item_[i]) moved_.push_back(i), mark_item_[i] = 1;
    for (Index i : moved_) mark_item_[i] = 0;
    return true;
  }

 private:
  struct Scratch {
    std::vector<Index> desc, chosen, tmp, pool;
    std::vector<char> taken;
    std::vector<uint64_t> keys;
  };

  // Ranks [r0, r1) above the cut shed a near-minimal set each, into s.pool.
  void shed_range(Index r0, Index r1, double cut, Scratch& s) {
    s.pool.clear();
    for (Index r = r0; r < r1; ++r) {
      if (load_[r] <= cut) continue;
      items_of(r, s.desc, s.keys);
      shed_set(s.desc.data(), static_cast<Index>(s.desc.size()), w_, load_[r] - cut, s.chosen, s.tmp, s.taken);
      for (Index i : s.chosen) {
        s.pool.push_back(i);
        load_[r] -= w_[i];
      }
    }
  }

  // Every rank above the cut sheds; ranks are independent, so large problems split them over two
  // threads (the shed examples are sorted afterwards: the result does not depend on the split).
  void shed_all(double cut) {
    if (n_ < 100000 || d_ < 64) {
      shed_range(0, d_, cut, main_);
      pool_.swap(main_.pool);
      return;
    }
    const Index mid = d_ / 2;
    std::thread other([&] { shed_range(mid, d_, cut, second_); });
    shed_range(0, mid, cut, main_);
    other.join();
    pool_.swap(main_.pool);
    pool_.insert(pool_.end(), second_.pool.begin(), second_.pool.end());
  }

  // `v` heaviest first, ties by index. Weights grow with lengths (additive costs), so this is
  // lengths descending: packed (max - length) << 32 | index words, one integer sort.
  void sort_heavier_first(std::vector<Index>& v) { sort_heavier_first(v, keys_); }
  void sort_heavier_first(std::vector<Index>& v, std::vector<uint64_t>& keys) const {
    const int idx_bits = bit_width(static_cast<uint64_t>(n_));
    const int len_bits = bit_width(static_cast<uint64_t>(max_len_));
    if (idx_bits + len_bits <= 64) {
      keys.resize(v.size());
      for (size_t k = 0; k < v.size(); ++k)
        keys[k] = (static_cast<uint64_t>(max_len_ - len_[v[k]]) << idx_bits) | static_cast<uint64_t>(v[k]);
      if (v.size() < 4096) {
        std::sort(keys.begin(), keys.end());
      } else {  // long lists (all shed examples): an LSD radix sort on the packed words
        radix_sort(keys, idx_bits + len_bits);
      }
      const uint64_t mask = (uint64_t{1} << idx_bits) - 1;
      for (size_t k = 0; k < v.size(); ++k) v[k] = static_cast<Index>(keys[k] & mask);
      return;
    }
    std::sort(v.begin(), v.end(), [&](Index p, Index q) { return w_[p] > w_[q] || (w_[p] == w_[q] && p < q); });
  }

  // Marks (mark_item_) the shed examples that must leave their node; places the others on it
  // where they fit (marking the ones that do not, too).
  void split_by_node(double T, std::vector<Index>& dst) {
    const Index nodes = d_ / per_;
    // shed examples by node of their source, heaviest first within a node
    node_start_.assign(nodes + 1, 0);
    for (Index i : pool_) ++node_start_[node_of_[src_[i]] + 1];
    for (Index m = 0; m < nodes; ++m) node_start_[m + 1] += node_start_[m];
    node_items_.resize(pool_.size());
    fill_.assign(node_start_.begin(), node_start_.end() - 1);
    for (Index i : pool_) node_items_[fill_[node_of_[src_[i]]]++] = i;
    off_.assign(d_, 0.0);
    local_.clear();
    lists_.resize(per_), used_.resize(per_), left_.resize(per_);
    for (Index m = 0; m < nodes; ++m) {
      const Index b = node_start_[m], e = node_start_[m + 1];
      if (b == e) continue;
      double shed = 0.0, room = 0.0;
      for (Index k = b; k < e; ++k) shed += w_[node_items_[k]];
      for (Index r = m * per_; r < (m + 1) * per_; ++r) room += std::max(0.0, T - load_[r]);
      double need = shed - room;
      if (need > 0) {
        // every shedding rank of the node: its shed examples, heaviest first
        for (Index q = 0; q < per_; ++q) lists_[q].clear(), used_[q].clear();
        for (Index k = b; k < e; ++k) lists_[src_[node_items_[k]] - m * per_].push_back(node_items_[k]);
        for (Index q = 0; q < per_; ++q) used_[q].assign(lists_[q].size(), 0), left_[q] = lists_[q].size();
        while (need > 0) {
          // the shedding rank with the least off-node volume so far sends its largest example
          // that does not overshoot the need (else its smallest)
          Index pick = -1;
          for (Index q = 0; q < per_; ++q) {
            if (left_[q] == 0) continue;
            if (pick < 0 || off_[m * per_ + q] < off_[m * per_ + pick]) pick = q;
          }
          if (pick < 0) break;
          const auto& lst = lists_[pick];
          auto& used = used_[pick];
          Index best = -1;
          for (size_t k = 0; k < lst.size(); ++k) {
            if (used[k]) continue;
            if (w_[lst[k]] <= need) {
              best = static_cast<Index>(k);
              break;
            }
          }
          if (best < 0)
            for (size_t k = lst.size(); k-- > 0;)
              if (!used[k]) {
                best = static_cast<Index>(k);
                break;
              }
          used[best] = 1, --left_[pick];
          const Index i = lst[best];
          mark_item_[i] = 1;  // goes off-node
          off_[src_[i]] += w_[i];
          need -= w_[i];
        }
      }
      for (Index k = b; k < e; ++k)
        if (!mark_item_[node_items_[k]]) local_.push_back(node_items_[k]);
    }
    // in-node placements first (heaviest first within each node), the rest joins the remote list
    for (Index i : local_) {
      const Index home = src_[i];
      Index to = -1;
      if (T - load_[home] >= w_[i]) {
        to = home;
      } else {
        to = best_in_node(node_of_[home], w_[i], T);
      }
      if (to < 0) {
        mark_item_[i] = 1;  // no room on its node after all: remote
        continue;
      }
      dst[i] = to;
      load_[to] += w_[i];
    }
  }

  Index best_in_node(Index node, double wi, double T) const {
    Index best = -1;
    double best_free = kInf;
    for (Index r = node * per_; r < (node + 1) * per_; ++r) {
      const double f = T - load_[r];
      if (f >= wi && f < best_free) best = r, best_free = f;
    }
    return best;
  }

  // Free capacity of every rank, searchable by size (only needed for the remote examples).
  void build_free_index(double T) {
    free_.clear();
    for (Index r = 0; r < d_; ++r)
      if (T - load_[r] > 0) free_.insert({T - load_[r], r});
    index_T_ = T;
  }

  void move_load(Index r, double add) {
    const double T = index_T_;
    if (T - load_[r] > 0) free_.erase({T - load_[r], r});
    load_[r] += add;
    if (T - load_[r] > 0) free_.insert({T - load_[r], r});
  }

  void put(Index i, double T, std::vector<Index>& dst) {
    const Index home = src_[i];
    Index to = -1;
    if (T - load_[home] >= w_[i]) {
      to = home;
    } else if (per_ < d_) {
      to = best_in_node(node_of_[home], w_[i], T);
    }
    if (to < 0) {
      auto it = free_.lower_bound({w_[i], std::numeric_limits<Index>::min()});
      if (it != free_.end()) {
        to = it->second;
      } else {
        // fits nowhere: the rank with the most room takes it, a repair round sheds again
        to = free_.empty() ? least_loaded() : std::prev(free_.end())->second;
        overflow_ = true;
      }
    }
    dst[i] = to;
    move_load(to, w_[i]);
  }

  Index least_loaded() const {
    Index best = 0;
    for (Index r = 1; r < d_; ++r)
      if (load_[r] < load_[best]) best = r;
    return best;
  }

  void collect_over(double T, std::vector<Index>& dst) {
    // examples currently on each overloaded rank (one pass), then shed as in round 0
    over_.clear();
    for (Index r = 0; r < d_; ++r)
      if (load_[r] > T) over_.push_back(r);
    if (over_.empty()) return;
    mark_.assign(d_, -1);
    for (size_t k = 0; k < over_.size(); ++k) mark_[over_[k]] = static_cast<Index>(k);
    std::vector<std::vector<Index>> on(over_.size());
    for (Index i = 0; i < n_; ++i)
      if (mark_[dst[i]] >= 0) on[mark_[dst[i]]].push_back(i);
    for (size_t k = 0; k < over_.size(); ++k) {
      const Index r = over_[k];
      desc_ = on[k];
      sort_heavier_first(desc_);
      shed_set(desc_.data(), static_cast<Index>(desc_.size()), w_, load_[r] - T, chosen_, tmp_, taken_);
      for (Index i : chosen_) {
        pool_.push_back(i);
        move_load(r, -w_[i]);
      }
    }
  }

 private:
  const double* w_ = nullptr;
  Index n_ = 0, d_ = 0, per_ = 1;
  const Index* src_ = nullptr;
  std::vector<Index> node_of_, moved_, shed_, fill_;
  Scratch main_, second_;
  std::vector<uint64_t> keys_;
  std::vector<char> mark_item_;
  const int64_t* len_ = nullptr;
  int64_t max_len_ = 0;
  bool rank_major_ = true;
  Csr by_src_;
  std::vector<double> load0_, load_, off_;
  std::vector<Index> pool_, remote_, local_, desc_, chosen_, tmp_, node_start_, node_items_, over_, mark_;
  std::vector<char> taken_;
  std::vector<std::vector<Index>> lists_;
  std::vector<std::vector<char>> used_;
  std::vector<size_t> left_;
  std::set<std::pair<double, Index>> free_;
  double index_T_ = 0.0;
  bool overflow_ = false;
};

// Lower the largest per-rank off-node send (OrchMLLM eq. 5) by relays: when rank r sends x to
// another node, a node-mate u can take x instead and send a few of its own examples Y, of about
// the same total size, to x's destination t. Loads stay within `target`; a relay moves Y in
// addition, so it is taken only when it strictly lowers max(off[r], off[u]). Stops at the first
// largest sender that no relay improves. Only moved examples can cross nodes, so only they are
// visited (plus the kept examples of the node-mates a relay considers).
void level_off_node(const double* w, Index d, Index per, const Index* src, Placer& placer, double target,
                    std::vector<Index>& dst) {
  const auto& node_of = placer.node_of();
  const auto& moved = placer.moved();
  std::vector<double> load = placer.loads();
  std::vector<double> off(d, 0.0);
  std::vector<std::vector<Index>> sent(d);
  for (Index i : moved) {
    if (node_of[dst[i]] != node_of[src[i]]) {
      off[src[i]] += w[i];
      sent[src[i]].push_back(i);
    }
  }
  auto heavier = [&](Index p, Index q) { return w[p] > w[q] || (w[p] == w[q] && p < q); };
  // examples a rank keeps at home (relay material), heaviest first, built when first needed, and
  // their total (a relay needing more than that is skipped without a scan)
  std::vector<std::vector<Index>> kept(d);
  std::vector<double> kept_sum(d, 0.0);
  std::vector<char> built(d, 0);
  std::vector<Index> scratch;
  auto kept_of = [&](Index u) -> std::vector<Index>& {
    if (!built[u]) {
      placer.items_of(u, scratch);  // heaviest first
      for (Index i : scratch)
        if (dst[i] == u && w[i] > 0) kept[u].push_back(i), kept_sum[u] += w[i];
      built[u] = 1;
    }
    return kept[u];
  };
  using Entry = std::pair<double, Index>;  // (off volume, -rank): the largest, lowest rank first
  std::priority_queue<Entry> heap;
  Index senders = 0;
  for (Index r = 0; r < d; ++r)
    if (off[r] > 0) heap.push({off[r], -r}), ++senders;
  std::vector<Index> ys, best_ys;
  for (Index it = 0; it < 4 * senders && !heap.empty(); ++it) {
    const auto [v, neg] = heap.top();
    heap.pop();
    const Index r = -neg;
    if (v != off[r]) continue;  // stale
    if (off[r] <= 0) break;
    double best = off[r];
    Index bx = -1, bu = -1;
    const Index first = node_of[r] * per;
    for (Index x : sent[r]) {
      const Index t = dst[x];
      for (Index u = first; u < first + per; ++u) {
        if (u == r || off[u] >= best) continue;  // u's volume would only grow
        const double lo = w[x] - (target - load[u]), hi = w[x] + (target - load[t]);
        auto& ku = kept_of(u);
        if (ku.empty() || kept_sum[u] < lo || w[ku.back()] > hi) continue;
        // relays that would not beat the best found so far need no scan either
        if (std::max(off[r] - w[x], off[u] + std::max(lo, w[ku.back()])) >= best) continue;
        ys.clear();
        double sum = 0.0;
        for (Index y : ku) {
          if (sum >= lo) break;
          if (sum + w[y] <= hi) ys.push_back(y), sum += w[y];
        }
        if (ys.empty() || sum < lo || sum > hi) continue;
        const double m = std::max(off[r] - w[x], off[u] + sum);
        if (m < best) best = m, bx = x, bu = u, best_ys = ys;
      }
    }
    if (bx < 0) break;  // the largest sender cannot be relieved: the objective cannot improve
    const Index t = dst[bx];
    double moved_sum = 0.0;
    dst[bx] = bu;
    auto& ku = kept_of(bu);
    for (Index y : best_ys) {
      dst[y] = t;
      moved_sum += w[y];
      ku.erase(std::find(ku.begin(), ku.end(), y));
      kept_sum[bu] -= w[y];
      sent[bu].push_back(y);
    }
    load[bu] += w[bx] - moved_sum;
    load[t] += moved_sum - w[bx];
    off[r] -= w[bx];
    off[bu] += moved_sum;
    sent[r].erase(std::find(sent[r].begin(), sent[r].end(), bx));
    heap.push({off[r], -r});
    heap.push({off[bu], -bu});
  }
}

}  // namespace

const std::vector<Index>& balance_local(const int64_t* lengths, Index n, Index d, const CostModel& cm,
                                        const Index* src, Index rpn, double tolerance) {
  // the plan lives in a per-thread buffer reused from call to call (see Placer)
  thread_local std::vector<Index> dst;
  if (n == 0 || d == 1) return dst.assign(src, src + n), dst;
  const bool additive = cm.policy == Policy::Sum || cm.policy == Policy::Quadratic;
  auto regroup = [&](const std::vector<Index>& groups) {
    const auto rank_of = assign_groups(lengths, n, groups.data(), src, d, rpn);
    std::vector<Index> dst(n);
    for (Index i = 0; i < n; ++i) dst[i] = rank_of[groups[i]];
    return dst;
  };
  if (!additive) {
    dst = regroup(balance(lengths, n, d, cm));
    return dst;
  }

  thread_local std::vector<double> w;
  w.resize(n);
  double total = 0.0, wmax = 0.0;
  bool integral = true;  // "sum" weights are the (integer) lengths
  if (cm.policy == Policy::Sum) {
    for (Index i = 0; i < n; ++i) {
      w[i] = static_cast<double>(lengths[i]);
      total += w[i], wmax = std::max(wmax, w[i]);
    }
  } else {
    for (Index i = 0; i < n; ++i) {
      w[i] = item_weight(lengths[i], cm);
      integral = integral && w[i] == std::floor(w[i]);
      total += w[i], wmax = std::max(wmax, w[i]);
    }
  }
  const double avg = total / static_cast<double>(d);
  const double lower = std::max(wmax, integral ? std::ceil(avg) : avg);
  const Index per = rpn > 0 ? rpn : d;
  thread_local Placer placer;
  placer.reset(w.data(), lengths, n, d, per, src);
  const auto& load0 = placer.source_loads();
  // The target: the lower bound plus the tolerance; only if that fails, the plain plan's makespan
  // (so the makespan is at most max(lower bound x (1 + tolerance), plain plan)).
  double target = lower * (1.0 + tolerance);
  if (*std::max_element(load0.begin(), load0.end()) <= target) return dst.assign(src, src + n), dst;
  auto attempt = [&](double T) {
    // shed down to T; if the gaps are too fragmented, shed a little more and retry
    if (placer.place(T, T, dst)) return true;
    const double cut = T - 0.5 * (T - avg) - 0.01 * wmax;
    return placer.place(T, std::max(cut, 0.0), dst);
  };
  bool ok = attempt(target);
  if (!ok) {
    auto plain = balance(lengths, n, d, cm);
    const double m_plain = max_cost(lengths, n, plain, d, cm);
    if (m_plain > target) {
      target = m_plain;
      ok = attempt(target);
    }
    if (!ok) {  // rare: keep the plain plan's balance, choose ranks for its batches
      dst = regroup(plain);
      for (Index i = 0; i < n; ++i)  // examples that cost nothing stay (the makespan cannot rise)
        if (w[i] == 0.0) dst[i] = src[i];
      return dst;
    }
  }
  if (per < d)
    level_off_node(w.data(), d, per, src, placer, target, dst);
  // Examples that cost nothing have no reason to travel (only moved ones can have).
  for (Index i : placer.moved())
    if (w[i] == 0.0) dst[i] = src[i];
  return dst;
}

}  // namespace mmb
