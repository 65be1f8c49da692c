// Locality-aware post-balancing: reach the balanced makespan while moving as few tokens as
// possible, and move them within the source's node where that suffices.
//
// OrchMLLM (section 5.2.2) balances first and then permutes whole batches across nodes; examples
// land on arbitrary ranks and almost every token crosses the network. Here a rank keeps its own
// examples up to the target makespan T, sheds a near-minimal set above T, and the shed examples fill
// the free capacity below T, best fit, own node first.
#include <algorithm>
#include <limits>
#include <map>
#include <set>
#include <tuple>
#include <utility>

#include "balance.hpp"

namespace mmb {

namespace {

// A near-minimal-sum subset of `items` (weights w) whose sum is >= excess.
std::vector<Index> shed_set(const std::vector<Index>& items, const double* w, double excess) {
  std::vector<Index> desc = items;
  std::sort(desc.begin(), desc.end(), [&](Index p, Index q) { return w[p] > w[q] || (w[p] == w[q] && p < q); });
  auto sum_of = [&](const std::vector<Index>& v) {
    double s = 0;
    for (Index i : v) s += w[i];
    return s;
  };
  // A: largest items that still fit under the excess, then the smallest item that closes it.
  std::vector<Index> a;
  std::vector<char> taken(desc.size(), 0);
  double rem = excess;
  for (size_t k = 0; k < desc.size() && rem > 0; ++k) {
    if (w[desc[k]] <= rem) a.push_back(desc[k]), taken[k] = 1, rem -= w[desc[k]];
  }
  if (rem > 0) {
    for (size_t k = desc.size(); k-- > 0;) {
      if (!taken[k] && w[desc[k]] >= rem) {
        a.push_back(desc[k]);
        rem = 0;
        break;
      }
    }
  }
  if (rem > 0) a = desc;  // cannot happen when the rank's load exceeds the excess
  std::vector<Index> best = a;
  double best_sum = sum_of(a);
  // B: the single smallest item that covers the excess.
  for (size_t k = desc.size(); k-- > 0;) {
    if (w[desc[k]] >= excess) {
      if (w[desc[k]] < best_sum || (w[desc[k]] == best_sum && best.size() > 1)) best = {desc[k]}, best_sum = w[desc[k]];
      break;
    }
  }
  // C: smallest items until covered, then drop those no longer needed (largest first).
  std::vector<Index> c;
  double s = 0;
  for (size_t k = desc.size(); k-- > 0 && s < excess;) c.push_back(desc[k]), s += w[desc[k]];
  for (size_t k = c.size(); k-- > 0;) {
    if (s - w[c[k]] >= excess) s -= w[c[k]], c.erase(c.begin() + static_cast<std::ptrdiff_t>(k));
  }
  if (s >= excess && s < best_sum) best = c, best_sum = s;
  return best;
}

// Lower the largest per-rank off-node send (OrchMLLM eq. 5) by relays: when rank r sends x to
// another node, a node-mate u can take x instead and send a few of its own examples Y, of about
// the same total size, to x's destination t. Loads stay within `target`; a relay moves Y in
// addition, so it is taken only when it strictly lowers max(off[r], off[u]).
void level_off_node(const double* w, Index n, Index d, Index per, const Index* src, double target,
                    std::vector<Index>& dst) {
  std::vector<double> load(d, 0.0), off(d, 0.0);
  std::vector<std::vector<Index>> sent(d), kept(d);
  for (Index i = 0; i < n; ++i) {
    load[dst[i]] += w[i];
    if (dst[i] / per != src[i] / per) {
      off[src[i]] += w[i];
      sent[src[i]].push_back(i);
    } else if (dst[i] == src[i] && w[i] > 0) {
      kept[src[i]].push_back(i);
    }
  }
  auto heavier = [&](Index p, Index q) { return w[p] > w[q] || (w[p] == w[q] && p < q); };
  for (auto& k : kept) std::sort(k.begin(), k.end(), heavier);
  std::vector<Index> ys, best_ys;
  for (Index it = 0; it < 4 * d; ++it) {
    Index r = 0;
    for (Index q = 1; q < d; ++q)
      if (off[q] > off[r]) r = q;
    if (off[r] <= 0) break;
    double best = off[r];
    Index bx = -1, bu = -1;
    for (Index x : sent[r]) {
      const Index t = dst[x];
      for (Index u = (r / per) * per; u < (r / per + 1) * per; ++u) {
        if (u == r) continue;
        const double lo = w[x] - (target - load[u]), hi = w[x] + (target - load[t]);
        // Largest-first subset of u's kept examples with a sum in [lo, hi].
        ys.clear();
        double sum = 0.0;
        for (Index y : kept[u]) {
          if (sum >= lo) break;
          if (sum + w[y] <= hi) ys.push_back(y), sum += w[y];
        }
        if (ys.empty() || sum < lo || sum > hi) continue;
        const double m = std::max(off[r] - w[x], off[u] + sum);
        if (m < best) best = m, bx = x, bu = u, best_ys = ys;
      }
    }
    if (bx < 0) break;
    const Index t = dst[bx];
    double moved = 0.0;
    dst[bx] = bu;
    for (Index y : best_ys) {
      dst[y] = t;
      moved += w[y];
      kept[bu].erase(std::find(kept[bu].begin(), kept[bu].end(), y));
      sent[bu].push_back(y);
    }
    load[bu] += w[bx] - moved;
    load[t] += moved - w[bx];
    off[r] -= w[bx];
    off[bu] += moved;
    sent[r].erase(std::find(sent[r].begin(), sent[r].end(), bx));
  }
}

}  // namespace

std::vector<Index> assign_groups(const int64_t* lengths, Index n, const Index* group, const Index* src, Index d,
                                 Index rpn) {
  // Overlap (tokens of group g that were sampled on rank r), as sorted (g, r) runs.
  std::vector<std::pair<Index, Index>> keys(n);
  for (Index i = 0; i < n; ++i) keys[i] = {group[i] * d + src[i], i};
  std::sort(keys.begin(), keys.end());
  std::vector<std::tuple<int64_t, Index, Index>> entries;  // (-tokens, g, r)
  std::vector<Index> first_of_group(d + 1, 0);
  for (Index k = 0; k < n;) {
    Index j = k;
    int64_t tok = 0;
    while (j < n && keys[j].first == keys[k].first) tok += lengths[keys[j].second], ++j;
    entries.emplace_back(-tok, keys[k].first / d, keys[k].first % d);
    ++first_of_group[keys[k].first / d + 1];
    k = j;
  }
  for (Index g = 0; g < d; ++g) first_of_group[g + 1] += first_of_group[g];
  const auto by_group = entries;  // still in (g, r) order: group g owns [first_of_group[g], first_of_group[g+1])
  std::sort(entries.begin(), entries.end());
  std::vector<Index> rank_of(d, -1), group_on(d, -1);
  for (auto& [neg, g, r] : entries) {
    if (rank_of[g] < 0 && group_on[r] < 0) rank_of[g] = r, group_on[r] = g;
  }
  // Groups left over go to a free rank of the node that contributed most of their tokens.
  const Index per = rpn > 0 ? rpn : d;
  const Index nodes = d / per;
  std::vector<Index> free_in_node(nodes, 0);
  for (Index r = 0; r < d; ++r) free_in_node[r / per] += group_on[r] < 0;
  std::vector<int64_t> tok(nodes);
  for (Index g = 0; g < d; ++g) {
    if (rank_of[g] >= 0) continue;
    std::fill(tok.begin(), tok.end(), 0);
    for (Index k = first_of_group[g]; k < first_of_group[g + 1]; ++k)
      tok[std::get<2>(by_group[k]) / per] -= std::get<0>(by_group[k]);
    Index best_node = -1;
    for (Index m = 0; m < nodes; ++m)
      if (free_in_node[m] > 0 && (best_node < 0 || tok[m] > tok[best_node])) best_node = m;
    for (Index r = best_node * per; r < (best_node + 1) * per; ++r) {
      if (group_on[r] < 0) {
        rank_of[g] = r, group_on[r] = g, --free_in_node[best_node];
        break;
      }
    }
  }
  return rank_of;
}

std::vector<Index> balance_local(const int64_t* lengths, Index n, Index d, const CostModel& cm, const Index* src,
                                 Index rpn, double tolerance) {
  auto plain = balance(lengths, n, d, cm);
  if (n == 0 || d == 1) return plain;
  const bool additive = cm.policy == Policy::Sum || cm.policy == Policy::Quadratic;
  auto regroup = [&](const std::vector<Index>& groups) {
    const auto rank_of = assign_groups(lengths, n, groups.data(), src, d, rpn);
    std::vector<Index> dst(n);
    for (Index i = 0; i < n; ++i) dst[i] = rank_of[groups[i]];
    return dst;
  };
  if (!additive) return regroup(plain);

  std::vector<double> w(n);
  for (Index i = 0; i < n; ++i) w[i] = item_weight(lengths[i], cm);
  const double m_plain = max_cost(lengths, n, plain, d, cm);
  double total = 0.0, wmax = 0.0;
  for (Index i = 0; i < n; ++i) total += w[i], wmax = std::max(wmax, w[i]);
  const double lower = std::max(wmax, total / static_cast<double>(d));
  // The target: the plain plan's makespan, or the lower bound plus `tolerance`, whichever is larger.
  const double target = std::max(m_plain, lower * (1.0 + tolerance));
  const Index per = rpn > 0 ? rpn : d;
  // One placement pass; ranks first shed down to `cut` (<= target: shedding a little more leaves
  // room for small examples when the gaps are too fragmented).
  auto place = [&](double cut) {
    std::vector<std::vector<Index>> on(d);
    std::vector<double> load(d, 0.0);
    std::vector<Index> dst(src, src + n);
    for (Index i = 0; i < n; ++i) on[src[i]].push_back(i), load[src[i]] += w[i];

    // Free capacity below the target, searchable by size: globally and per node.
    using Slot = std::pair<double, Index>;
    std::set<Slot> global;
    std::vector<std::set<Slot>> node(d / per);
    for (Index r = 0; r < d; ++r) {
      global.insert({target - load[r], r});
      node[r / per].insert({target - load[r], r});
    }
    auto update = [&](Index r, double add) {
      global.erase({target - load[r], r});
      node[r / per].erase({target - load[r], r});
      load[r] += add;
      global.insert({target - load[r], r});
      node[r / per].insert({target - load[r], r});
    };
    // Rounds of: every rank above the target sheds a near-minimal set; shed examples go, largest
    // first, home if it has room, else best fit on the home node, else best fit anywhere, else to
    // the rank with the most room (an overflow the next round repairs by shedding again).
    std::vector<Index> pool;
    for (int round = 0; round < 32; ++round) {
      pool.clear();
      if (round > 0) cut = target;
      for (Index r = 0; r < d; ++r) {
        if (load[r] <= cut) continue;
        for (Index i : shed_set(on[r], w.data(), load[r] - cut)) {
          pool.push_back(i);
          on[r].erase(std::find(on[r].begin(), on[r].end(), i));
          update(r, -w[i]);
        }
      }
      if (pool.empty()) break;
      auto heavier = [&](Index p, Index q) { return w[p] > w[q] || (w[p] == w[q] && p < q); };
      std::sort(pool.begin(), pool.end(), heavier);
      if (round == 0 && per < d) {
        // A node whose shed examples exceed its free capacity must send the difference off-node.
        // Spread that duty over the node's shedding ranks (the straggler of the all-to-all is the
        // rank with the largest off-node volume), then place in-node examples first.
        std::vector<std::vector<Index>> from_node(d / per);
        for (Index i : pool) from_node[src[i] / per].push_back(i);
        std::vector<Index> local, remote;
        std::vector<double> off(d, 0.0);
        for (Index m = 0; m < d / per; ++m) {
          auto& items = from_node[m];
          double shed = 0.0, room = 0.0;
          for (Index i : items) shed += w[i];
          for (Index r = m * per; r < (m + 1) * per; ++r) room += std::max(0.0, target - load[r]);
          double need = shed - room;
          std::vector<char> out(items.size(), 0);
          while (need > 0) {
            // The rank with the least off-node volume so far that still has shed examples.
            Index pick = -1;
            for (size_t k = 0; k < items.size(); ++k) {
              if (out[k]) continue;
              const Index r = src[items[k]];
              if (pick < 0 || off[r] < off[src[items[pick]]] ||
                  (off[r] == off[src[items[pick]]] && r < src[items[pick]]))
                pick = static_cast<Index>(k);
            }
            if (pick < 0) break;
            // Its largest example that does not overshoot the need, else its smallest.
            const Index r = src[items[pick]];
            Index best = -1;
            for (size_t k = 0; k < items.size(); ++k) {
              if (out[k] || src[items[k]] != r) continue;
              const bool fits = w[items[k]] <= need;
              if (best < 0) {
                best = static_cast<Index>(k);
                continue;
              }
              const bool best_fits = w[items[best]] <= need;
              if (fits && (!best_fits || w[items[k]] > w[items[best]])) best = static_cast<Index>(k);
              if (!fits && !best_fits && w[items[k]] < w[items[best]]) best = static_cast<Index>(k);
            }
            out[best] = 1;
            off[r] += w[items[best]];
            need -= w[items[best]];
          }
          for (size_t k = 0; k < items.size(); ++k) (out[k] ? remote : local).push_back(items[k]);
        }
        for (Index i : local) {
          const Index home = src[i];
          Index to = -1;
          if (target - load[home] >= w[i]) {
            to = home;
          } else {
            auto& ns = node[home / per];
            auto it = ns.lower_bound({w[i], std::numeric_limits<Index>::min()});
            if (it != ns.end()) to = it->second;
          }
          if (to < 0) {
            remote.push_back(i);
            continue;
          }
          dst[i] = to;
          on[to].push_back(i);
          update(to, w[i]);
        }
        std::sort(remote.begin(), remote.end(), heavier);
        pool.swap(remote);
      }
      for (Index i : pool) {
        const Index home = src[i];
        Index to;
        if (target - load[home] >= w[i]) {
          to = home;
        } else {
          auto& ns = node[home / per];
          auto it = ns.lower_bound({w[i], std::numeric_limits<Index>::min()});
          if (it != ns.end()) {
            to = it->second;
          } else {
            auto g = global.lower_bound({w[i], std::numeric_limits<Index>::min()});
            to = g != global.end() ? g->second : std::prev(global.end())->second;
          }
        }
        dst[i] = to;
        on[to].push_back(i);
        update(to, w[i]);
      }
    }
    return dst;
  };

  auto dst = place(target);
  const Index iters = std::min<Index>(4 * d + 64, 256);
  if (max_cost(lengths, n, dst, d, cm) > target) refine_additive(w.data(), n, d, dst, iters);
  if (max_cost(lengths, n, dst, d, cm) > target) {
    dst = place(target - 0.5 * (target - total / static_cast<double>(d)) - 0.01 * wmax);
    if (max_cost(lengths, n, dst, d, cm) > target) refine_additive(w.data(), n, d, dst, iters);
  }
  if (max_cost(lengths, n, dst, d, cm) <= target) {
    if (per < d) level_off_node(w.data(), n, d, per, src, target, dst);
  } else {
    // The repair rounds did not converge (rare: no small examples to fill the gaps): keep the
    // plain plan's balance and only choose which rank gets which of its batches.
    dst = regroup(plain);
  }
  // Examples that cost nothing have no reason to travel.
  for (Index i = 0; i < n; ++i)
    if (w[i] == 0.0) dst[i] = src[i];
  return dst;
}

}  // namespace mmb
