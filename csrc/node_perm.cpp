// Node-wise rearrangement (OrchMLLM section 5.2.2, algorithm 3).
//
// Permuting the new batches over ranks leaves every batch's cost unchanged but decides how many
// tokens cross node boundaries. The objective is the largest off-node send volume of any source
// rank (the straggler of the all-to-all). The paper solves an ILP; this is the fast heuristic for
// large clusters: batches go to the node that sampled most of their tokens (greedy, with node
// capacity), then pairwise swaps of batches between nodes that lower the worst rank's volume.
#include <algorithm>
#include <tuple>
#include <unordered_map>
#include <utility>

#include "node_perm.hpp"
#include "csr.hpp"
#include "radix.hpp"
#include "scratch.hpp"

namespace mmb {

namespace {

struct Sparse {
  // rows[k] in [start[x], start[x+1]) hold (other, tokens) pairs for key x
  std::vector<Index> start;
  std::vector<std::pair<Index, int64_t>> rows;
};

// Aggregate tokens by (key_of_item, other_of_item): row per key, sorted by other.
Sparse aggregate(const int64_t* lengths, Index n, const Index* key, const Index* other, Index num_keys,
                 Index num_other) {
  std::vector<std::pair<Index, Index>> ks(n);
  for (Index i = 0; i < n; ++i) ks[i] = {key[i] * num_other + other[i], i};
  std::sort(ks.begin(), ks.end());
  Sparse s;
  s.start.assign(num_keys + 1, 0);
  for (Index k = 0; k < n;) {
    Index j = k;
    int64_t tok = 0;
    while (j < n && ks[j].first == ks[k].first) tok += lengths[ks[j].second], ++j;
    s.rows.emplace_back(ks[k].first % num_other, tok);
    ++s.start[ks[k].first / num_other + 1];
    k = j;
  }
  for (Index x = 0; x < num_keys; ++x) s.start[x + 1] += s.start[x];
  return s;
}

}  // namespace

std::vector<Index> place_within_nodes(const int64_t* lengths, Index n, const Index* batch, const Index* src, Index d,
                                      Index rpn, const std::vector<Index>& node_of_batch) {
  const Index per = rpn;
  const Sparse by_batch = aggregate(lengths, n, batch, src, d, d);
  std::vector<std::tuple<int64_t, Index, Index>> entries;  // (-tokens, batch, rank) within one node
  for (Index b = 0; b < d; ++b) {
    for (Index k = by_batch.start[b]; k < by_batch.start[b + 1]; ++k) {
      const auto [r, tok] = by_batch.rows[k];
      if (r / per == node_of_batch[b]) entries.emplace_back(-tok, b, r);
    }
  }
  std::sort(entries.begin(), entries.end());
  std::vector<Index> rank_of(d, -1), taken(d, 0);
  for (auto& [neg, b, r] : entries)
    if (rank_of[b] < 0 && !taken[r]) rank_of[b] = r, taken[r] = 1;
  std::vector<Index> next(d / per, 0);
  for (Index b = 0; b < d; ++b) {
    if (rank_of[b] >= 0) continue;
    const Index m = node_of_batch[b];
    Index& r = next[m];
    while (taken[m * per + r]) ++r;
    rank_of[b] = m * per + r;
    taken[m * per + r] = 1;
  }
  return rank_of;
}

std::vector<Index> node_permutation(const int64_t* lengths, Index n, const Index* batch, const Index* src, Index d,
                                    Index rpn, Index max_iters) {
  const Index per = rpn;
  const Index nodes = d / per;
  std::vector<Index> src_node(n);
  for (Index i = 0; i < n; ++i) src_node[i] = src[i] / per;
  const Sparse batch_node = aggregate(lengths, n, batch, src_node.data(), d, nodes);
  const Sparse batch_src = aggregate(lengths, n, batch, src, d, d);
  const Sparse src_batch = aggregate(lengths, n, src, batch, d, d);

  // Greedy: largest (batch, node) token counts first, at most `per` batches per node.
  std::vector<std::tuple<int64_t, Index, Index>> entries;
  for (Index b = 0; b < d; ++b)
    for (Index k = batch_node.start[b]; k < batch_node.start[b + 1]; ++k)
      entries.emplace_back(-batch_node.rows[k].second, b, batch_node.rows[k].first);
  std::sort(entries.begin(), entries.end());
  std::vector<Index> node_of(d, -1), fill(nodes, 0);
  for (auto& [neg, b, m] : entries)
    if (node_of[b] < 0 && fill[m] < per) node_of[b] = m, ++fill[m];
  Index m = 0;
  for (Index b = 0; b < d; ++b) {
    if (node_of[b] >= 0) continue;
    while (fill[m] >= per) ++m;
    node_of[b] = m, ++fill[m];
  }
  std::vector<std::vector<Index>> on_node(nodes);
  for (Index b = 0; b < d; ++b) on_node[node_of[b]].push_back(b);

  // off[s]: tokens rank s sends to batches on other nodes.
  std::vector<int64_t> off(d, 0);
  for (Index s = 0; s < d; ++s)
    for (Index k = src_batch.start[s]; k < src_batch.start[s + 1]; ++k)
      if (node_of[src_batch.rows[k].first] != s / per) off[s] += src_batch.rows[k].second;

  std::unordered_map<Index, int64_t> delta;
  for (Index it = 0; it < max_iters && nodes > 1; ++it) {
    Index worst = 0;
    for (Index s = 1; s < d; ++s)
      if (off[s] > off[worst]) worst = s;
    const int64_t F = off[worst];
    if (F == 0) break;
    const Index home = worst / per;
    // Batches the worst rank feeds on other nodes, largest first.
    std::vector<std::pair<int64_t, Index>> cand;
    for (Index k = src_batch.start[worst]; k < src_batch.start[worst + 1]; ++k) {
      const auto [b, tok] = src_batch.rows[k];
      if (node_of[b] != home) cand.emplace_back(-tok, b);
    }
    std::sort(cand.begin(), cand.end());
    if (cand.size() > 8) cand.resize(8);
    int64_t best = F;
    Index best_b = -1, best_c = -1;
    for (auto& [neg, b] : cand) {
      const Index mb = node_of[b];
      for (Index c : on_node[home]) {
        // Swap: b moves to `home`, c moves to `mb`.
        delta.clear();
        for (Index k = batch_src.start[b]; k < batch_src.start[b + 1]; ++k) {
          const auto [s, tok] = batch_src.rows[k];
          if (s / per == mb) delta[s] += tok;
          if (s / per == home) delta[s] -= tok;
        }
        for (Index k = batch_src.start[c]; k < batch_src.start[c + 1]; ++k) {
          const auto [s, tok] = batch_src.rows[k];
          if (s / per == home) delta[s] += tok;
          if (s / per == mb) delta[s] -= tok;
        }
        int64_t worst_new = 0;
        for (auto& [s, dl] : delta) worst_new = std::max(worst_new, off[s] + dl);
        if (delta.find(worst) == delta.end()) worst_new = std::max(worst_new, F);
        if (worst_new < best) best = worst_new, best_b = b, best_c = c;
      }
    }
    if (best_b < 0) break;
    const Index mb = node_of[best_b];
    for (Index k = batch_src.start[best_b]; k < batch_src.start[best_b + 1]; ++k) {
      const auto [s, tok] = batch_src.rows[k];
      if (s / per == mb) off[s] += tok;
      if (s / per == home) off[s] -= tok;
    }
    for (Index k = batch_src.start[best_c]; k < batch_src.start[best_c + 1]; ++k) {
      const auto [s, tok] = batch_src.rows[k];
      if (s / per == home) off[s] += tok;
      if (s / per == mb) off[s] -= tok;
    }
    node_of[best_b] = home, node_of[best_c] = mb;
    auto& hv = on_node[home];
    *std::find(hv.begin(), hv.end(), best_c) = best_b;
    auto& mv = on_node[mb];
    *std::find(mv.begin(), mv.end(), best_b) = best_c;
  }
  return place_within_nodes(lengths, n, batch, src, d, rpn, node_of);
}

namespace {

struct Overlap {
  int64_t tok;
  Index grp, rnk;
};

// Overlap of every source rank with every group (tokens of group g sampled on rank r), one call
// emit(tok, g, r) per touching pair, ranks ascending: the examples by source rank (rank-major
// input: already in order, so memory is read in order), the groups of a rank summed in a scratch
// accumulator. O(n + d).
template <class Emit>
void overlaps(const int64_t* lengths, Index n, const Index* group, const Index* src, Index d, Emit emit) {
  const bool rank_major = std::is_sorted(src, src + n);
  Csr by_src;
  if (!rank_major) by_src.build(src, n, d);
  std::vector<int64_t> acc(d, 0);
  std::vector<Index> touched;
  for (Index k = 0; k < n;) {
    const Index r = src[rank_major ? k : by_src.order[k]];
    touched.clear();
    for (; k < n; ++k) {
      const Index i = rank_major ? k : by_src.order[k];
      if (src[i] != r) break;
      if (acc[group[i]] == 0 && lengths[i] > 0) touched.push_back(group[i]);
      acc[group[i]] += lengths[i];
    }
    for (Index g : touched) {
      emit(acc[g], g, r);
      acc[g] = 0;
    }
  }
}

// The overlaps by tokens descending, ties by (group, rank), as `m` records: a counting pass over
// the groups (ranks ascend within a group) and a stable LSD radix sort on the tokens. `grp` and
// `tok` read a record. Returns the buffer holding the result (a or b).
template <class T, class Grp, class Tok>
T* sort_overlaps(T* a, T* b, Index m, Index d, int64_t max_tok, Grp grp, Tok tok) {
  std::vector<Index> start(d + 1, 0);
  for (Index k = 0; k < m; ++k) ++start[grp(a[k]) + 1];
  for (Index g = 0; g < d; ++g) start[g + 1] += start[g];
  for (Index k = 0; k < m; ++k) b[start[grp(a[k])]++] = a[k];
  return radix_sort(b, a, static_cast<size_t>(m), bit_width(static_cast<uint64_t>(max_tok)),
                    [&](const T& e) { return static_cast<uint64_t>(max_tok - tok(e)); });
}

// Groups onto ranks from the overlaps in sorted order (all(f) calls f(Overlap) on each).
template <class All>
std::vector<Index> match_groups(Index d, Index rpn, All all) {
  std::vector<Index> rank_of(d, -1), group_on(d, -1);
  all([&](const Overlap& e) {
    if (rank_of[e.grp] < 0 && group_on[e.rnk] < 0) rank_of[e.grp] = e.rnk, group_on[e.rnk] = e.grp;
  });
  // Groups left over go to a free rank of the node that contributed most of their tokens (among
  // the nodes they touch), else to the first node with a free rank.
  const Index per = rpn > 0 ? rpn : d;
  const Index nodes = d / per;
  std::vector<Index> free_in_node(nodes, 0), next_free(nodes);
  for (Index r = 0; r < d; ++r) free_in_node[r / per] += group_on[r] < 0;
  for (Index q = 0; q < nodes; ++q) next_free[q] = q * per;
  auto take = [&](Index node, Index g) {
    Index& r = next_free[node];
    while (group_on[r] >= 0) ++r;
    rank_of[g] = r, group_on[r] = g, --free_in_node[node];
  };
  // the entries of the groups left over, by group
  std::vector<Index> slot(d, -1), left_start(1, 0);
  std::vector<Overlap> left;
  for (Index g = 0; g < d; ++g)
    if (rank_of[g] < 0) slot[g] = static_cast<Index>(left_start.size()) - 1, left_start.push_back(0);
  all([&](const Overlap& e) {
    if (slot[e.grp] >= 0) ++left_start[slot[e.grp] + 1];
  });
  for (size_t j = 1; j < left_start.size(); ++j) left_start[j] += left_start[j - 1];
  left.resize(static_cast<size_t>(left_start.back()));
  {
    std::vector<Index> fill(left_start.begin(), left_start.end() - 1);
    all([&](const Overlap& e) {
      if (slot[e.grp] >= 0) left[fill[slot[e.grp]]++] = e;
    });
  }
  std::vector<int64_t> node_tok(nodes, 0);
  std::vector<Index> seen;
  Index scan = 0;
  for (Index g = 0; g < d; ++g) {
    if (rank_of[g] >= 0) continue;
    seen.clear();
    for (Index k = left_start[slot[g]]; k < left_start[slot[g] + 1]; ++k) {
      const Index q = left[k].rnk / per;
      if (node_tok[q] == 0) seen.push_back(q);
      node_tok[q] += left[k].tok;
    }
    Index best = -1;
    for (Index q : seen)
      if (free_in_node[q] > 0 && (best < 0 || node_tok[q] > node_tok[best] || (node_tok[q] == node_tok[best] && q < best)))
        best = q;
    for (Index q : seen) node_tok[q] = 0;
    if (best < 0) {
      while (free_in_node[scan] == 0) ++scan;
      best = scan;
    }
    take(best, g);
  }
  return rank_of;
}

}  // namespace

std::vector<Index> assign_groups(const int64_t* lengths, Index n, const Index* group, const Index* src, Index d,
                                 Index rpn) {
  // Three words per overlap in general; one when tokens, group and rank fit in 64 bits together
  // (always at real sizes): a third of the memory traffic in the sort and the passes over it.
  uint64_t total = 0;  // an upper bound on any overlap, saturated at 2^62
  for (Index i = 0; i < n; ++i) total = std::min<uint64_t>(total + static_cast<uint64_t>(lengths[i]), uint64_t{1} << 62);
  const int id_bits = bit_width(static_cast<uint64_t>(std::max<Index>(d - 1, 1)));
  if (bit_width(total) + 2 * id_bits <= 64) {
    const uint64_t id_mask = (uint64_t{1} << id_bits) - 1;
    uint64_t* a = scratch<uint64_t, 2>(static_cast<size_t>(n));  // at most one per example
    uint64_t* b = scratch<uint64_t, 3>(static_cast<size_t>(n));
    Index m = 0;
    int64_t max_tok = 0;
    overlaps(lengths, n, group, src, d, [&](int64_t tok, Index g, Index r) {
      a[m++] = (static_cast<uint64_t>(tok) << (2 * id_bits)) | (static_cast<uint64_t>(g) << id_bits) |
               static_cast<uint64_t>(r);
      max_tok = std::max(max_tok, tok);
    });
    auto tok = [&](uint64_t e) { return static_cast<int64_t>(e >> (2 * id_bits)); };
    auto grp = [&](uint64_t e) { return static_cast<Index>((e >> id_bits) & id_mask); };
    const uint64_t* sorted = sort_overlaps(a, b, m, d, max_tok, grp, tok);
    return match_groups(d, rpn, [&](auto f) {
      for (Index k = 0; k < m; ++k) f(Overlap{tok(sorted[k]), grp(sorted[k]), static_cast<Index>(sorted[k] & id_mask)});
    });
  }
  Overlap* a = scratch<Overlap, 0>(static_cast<size_t>(n));
  Overlap* b = scratch<Overlap, 1>(static_cast<size_t>(n));
  Index m = 0;
  int64_t max_tok = 0;
  overlaps(lengths, n, group, src, d, [&](int64_t tok, Index g, Index r) {
    a[m++] = {tok, g, r};
    max_tok = std::max(max_tok, tok);
  });
  const Overlap* sorted = sort_overlaps(
      a, b, m, d, max_tok, [](const Overlap& e) { return e.grp; }, [](const Overlap& e) { return e.tok; });
  return match_groups(d, rpn, [&](auto f) {
    for (Index k = 0; k < m; ++k) f(sorted[k]);
  });
}

}  // namespace mmb
