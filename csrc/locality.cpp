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
#include "locality.hpp"
#include "csr.hpp"
#include "placer.hpp"

namespace mmb {

namespace {

// Lower the largest per-rank off-node send (OrchMLLM eq. 5) by relays: when rank r sends x to
// another node, a node-mate u can take x instead and send a few of its own examples Y, of about
// the same total size, to x's destination t. Loads stay within `target`; a relay moves Y in
// addition, so it is taken only when it strictly lowers max(off[r], off[u]). Stops at the first
// largest sender that no relay improves. Only moved examples can cross nodes, so only they are
// visited (plus the kept examples of the node-mates a relay considers).
void level_off_node(const double* w, Index d, Index per, const Index* src, const Placer& placer, double target,
                    Index* dst) {
  const auto& node_of = placer.node_of();
  const auto& moved = placer.moved();
  std::vector<double> load = placer.loads();
  std::vector<double> off(d, 0.0);
  // what each rank sends off-node: moved examples (by source rank, in moved order) and, after
  // them, examples it relays (a list per rank); an example sent no more (taken over by a
  // node-mate) is skipped, as its destination is then on its source's node
  Csr sent;
  thread_local std::vector<Index> crossing;
  crossing.clear();
  for (Index i : moved) {
    if (node_of[dst[i]] != node_of[src[i]]) {
      off[src[i]] += w[i];
      crossing.push_back(i);
    }
  }
  thread_local std::vector<Index> key;
  key.resize(crossing.size());
  for (size_t k = 0; k < crossing.size(); ++k) key[k] = src[crossing[k]];
  sent.build(key.data(), static_cast<Index>(crossing.size()), d);
  for (auto& k : sent.order) k = crossing[k];
  std::vector<Index> relay_head(d, -1), relay_tail(d, -1), relay_next, relay_item;
  auto still_sent = [&](Index x) { return node_of[dst[x]] != node_of[src[x]]; };
  // examples a rank keeps at home (relay material), heaviest first, built when first needed, and
  // their total (a relay needing more than that is skipped without a scan): segments of one
  // buffer, an example leaving its rank's segment shifts the rest of it down
  std::vector<Index> kept_start(d, -1), kept_len(d, 0), kept_buf;
  std::vector<double> kept_sum(d, 0.0);
  std::vector<Index> scratch;
  auto kept_of = [&](Index u) {
    if (kept_start[u] < 0) {
      placer.items_of(u, scratch);  // heaviest first
      kept_start[u] = static_cast<Index>(kept_buf.size());
      for (Index i : scratch)
        if (dst[i] == u && w[i] > 0) kept_buf.push_back(i), kept_sum[u] += w[i];
      kept_len[u] = static_cast<Index>(kept_buf.size()) - kept_start[u];
    }
    return std::make_pair(kept_buf.data() + kept_start[u], kept_len[u]);
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
    auto consider = [&](Index x) {
      const Index t = dst[x];
      for (Index u = first; u < first + per; ++u) {
        if (u == r || off[u] >= best) continue;  // u's volume would only grow
        const double lo = w[x] - (target - load[u]), hi = w[x] + (target - load[t]);
        const auto [ku, nk] = kept_of(u);
        if (nk == 0 || kept_sum[u] < lo || w[ku[nk - 1]] > hi) continue;
        // relays that would not beat the best found so far need no scan either
        if (std::max(off[r] - w[x], off[u] + std::max(lo, w[ku[nk - 1]])) >= best) continue;
        ys.clear();
        double sum = 0.0;
        for (Index k = 0; k < nk; ++k) {
          const Index y = ku[k];
          if (sum >= lo) break;
          if (sum + w[y] <= hi) ys.push_back(y), sum += w[y];
        }
        if (ys.empty() || sum < lo || sum > hi) continue;
        const double m = std::max(off[r] - w[x], off[u] + sum);
        if (m < best) best = m, bx = x, bu = u, best_ys = ys;
      }
    };
    for (Index k = sent.start[r]; k < sent.start[r + 1]; ++k)
      if (still_sent(sent.order[k])) consider(sent.order[k]);
    for (Index e = relay_head[r]; e >= 0; e = relay_next[e])
      if (still_sent(relay_item[e])) consider(relay_item[e]);
    if (bx < 0) break;  // the largest sender cannot be relieved: the objective cannot improve
    const Index t = dst[bx];
    double moved_sum = 0.0;
    dst[bx] = bu;
    kept_of(bu);
    Index* ku = kept_buf.data() + kept_start[bu];
    for (Index y : best_ys) {
      dst[y] = t;
      moved_sum += w[y];
      Index& nk = kept_len[bu];
      std::copy(std::find(ku, ku + nk, y) + 1, ku + nk, std::find(ku, ku + nk, y));
      --nk;
      kept_sum[bu] -= w[y];
      relay_item.push_back(y), relay_next.push_back(-1);  // bu sends y now
      const Index e = static_cast<Index>(relay_item.size()) - 1;
      if (relay_tail[bu] >= 0) relay_next[relay_tail[bu]] = e; else relay_head[bu] = e;
      relay_tail[bu] = e;
    }
    load[bu] += w[bx] - moved_sum;
    load[t] += moved_sum - w[bx];
    off[r] -= w[bx];
    off[bu] += moved_sum;
    heap.push({off[r], -r});
    heap.push({off[bu], -bu});
  }
}

}  // namespace

void keep_equal_lengths_home(const int64_t* lengths, Index n, Index d, const Index* src, Index per, Index* dst) {
  std::vector<Index> order;
  order_by_length_desc(lengths, n, order);
  std::vector<Index> places(d, 0), seen, node_head(d / per, -1), next(d, -1), waiting;
  for (Index a = 0; a < n;) {
    Index b = a + 1;
    while (b < n && lengths[order[b]] == lengths[order[a]]) ++b;
    if (b - a > 1) {
      // the length's places, by rank; then the examples at home
      seen.clear();
      for (Index k = a; k < b; ++k) {
        const Index r = dst[order[k]];
        if (places[r]++ == 0) seen.push_back(r);
      }
      waiting.clear();
      for (Index k = a; k < b; ++k) {
        const Index i = order[k];
        if (places[src[i]] > 0) {
          dst[i] = src[i], --places[src[i]];
        } else {
          waiting.push_back(i);
        }
      }
      // the places left, listed per node (ranks in the order first seen)
      for (auto it = seen.rbegin(); it != seen.rend(); ++it)
        if (places[*it] > 0) next[*it] = node_head[*it / per], node_head[*it / per] = *it;
      // on their node first (all of them, so none takes another node's place), then anywhere
      size_t far = 0;
      for (Index i : waiting) {
        Index& head = node_head[src[i] / per];
        while (head >= 0 && places[head] == 0) head = next[head];
        if (head >= 0)
          dst[i] = head, --places[head];
        else
          waiting[far++] = i;
      }
      size_t any = 0;
      for (size_t k = 0; k < far; ++k) {
        while (places[seen[any]] == 0) ++any;
        dst[waiting[k]] = seen[any], --places[seen[any]];
      }
      for (Index r : seen) node_head[r / per] = -1, places[r] = 0;
    }
    a = b;
  }
}

void balance_local(const int64_t* lengths, Index n, Index d, const CostModel& cm, const Index* src, Index rpn,
                   double tolerance, Index* dst) {
  if (n == 0 || d == 1) return void(std::copy(src, src + n, dst));
  const bool additive = cm.policy == Policy::Sum || cm.policy == Policy::Quadratic;
  auto regroup = [&](const std::vector<Index>& groups) {
    const auto rank_of = assign_groups(lengths, n, groups.data(), src, d, rpn);
    for (Index i = 0; i < n; ++i) dst[i] = rank_of[groups[i]];
  };
  if (!additive) return regroup(balance(lengths, n, d, cm));

  // weights, reused from call to call (a fresh multi-megabyte buffer costs page faults)
  thread_local std::vector<double> w;
  w.resize(n);
  double total = 0.0, wmax = 0.0;
  int64_t max_len = 0;
  bool integral = true;  // "sum" weights are the (integer) lengths
  if (cm.policy == Policy::Sum) {
    uint64_t sum = 0;  // exact: validated totals stay below 2^53
    for (Index i = 0; i < n; ++i) {
      w[i] = static_cast<double>(lengths[i]);
      sum += static_cast<uint64_t>(lengths[i]);
      max_len = std::max(max_len, lengths[i]);
    }
    total = static_cast<double>(sum), wmax = static_cast<double>(max_len);
  } else {
    for (Index i = 0; i < n; ++i) {
      w[i] = item_weight(lengths[i], cm);
      integral = integral && w[i] == std::floor(w[i]);
      total += w[i], wmax = std::max(wmax, w[i]);
      max_len = std::max(max_len, lengths[i]);
    }
  }
  const double avg = total / static_cast<double>(d);
  const double lower = std::max(wmax, integral ? std::ceil(avg) : avg);
  const Index per = rpn > 0 ? rpn : d;
  thread_local Placer placer;
  placer.reset(w.data(), lengths, n, d, per, src, max_len);
  const auto& load0 = placer.source_loads();
  // The target: the lower bound plus the tolerance; only if that fails, the plain plan's makespan
  // (so the makespan is at most max(lower bound x (1 + tolerance), plain plan)).
  double target = lower * (1.0 + tolerance);
  if (*std::max_element(load0.begin(), load0.end()) <= target) return void(std::copy(src, src + n, dst));
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
      regroup(plain);
      // Whole-image lengths (every weight a multiple of one size) land here, with many equal
      // lengths: exchanged, they go home (17x the needed movement otherwise, 4x with it). The
      // non-additive policies' batches are narrow length bands, where it gains 0.1% of the
      // tokens for a sort of all examples, so they go without.
      keep_equal_lengths_home(lengths, n, d, src, per, dst);
      for (Index i = 0; i < n; ++i)  // examples that cost nothing stay (the makespan cannot rise)
        if (w[i] == 0.0) dst[i] = src[i];
      return;
    }
  }
  if (per < d) level_off_node(w.data(), d, per, src, placer, target, dst);
  // Examples that cost nothing have no reason to travel (only moved ones can have).
  for (Index i : placer.moved())
    if (w[i] == 0.0) dst[i] = src[i];
}

}  // namespace mmb
