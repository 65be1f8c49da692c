// The placement step of locality-aware balancing; see placer.hpp.
#include "placer.hpp"

#include <algorithm>
#include <iterator>
#include <limits>

#include "helper_thread.hpp"
#include "radix.hpp"

namespace mmb {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

// Chooses a near-minimal-sum subset of the k items `desc` (sorted by weight descending, ties by
// index) whose sum is >= excess: the best of (A) the largest items that still fit under the
// excess and then the smallest one that closes it, (B) the single smallest item covering it, and
// (C) the smallest items until covered, minus those no longer needed. Writes the positions in
// `desc` of the chosen items to `out`, ascending (so the items heaviest first).
void shed_set(const Index* desc, Index k, const double* w, double excess, std::vector<Index>& out,
              std::vector<Index>& tmp) {
  // A
  out.clear();
  double rem = excess, best = 0.0;
  for (Index j = 0; j < k && rem > 0; ++j)
    if (w[desc[j]] <= rem) out.push_back(j), rem -= w[desc[j]];
  if (rem > 0) {  // the smallest untaken item that covers the rest
    size_t t = out.size();
    for (Index j = k; j-- > 0;) {
      while (t > 0 && out[t - 1] > j) --t;
      if ((t == 0 || out[t - 1] != j) && w[desc[j]] >= rem) {
        rem = 0;
        out.insert(out.begin() + static_cast<std::ptrdiff_t>(t), j);
        break;
      }
    }
  }
  if (rem > 0) {  // the rank's whole load is below the excess: cannot happen
    out.resize(k);
    for (Index j = 0; j < k; ++j) out[j] = j;
  }
  for (Index j : out) best += w[desc[j]];
  // B
  for (Index j = k; j-- > 0;) {
    if (w[desc[j]] >= excess) {
      if (w[desc[j]] < best || (w[desc[j]] == best && out.size() > 1)) out.assign(1, j), best = w[desc[j]];
      break;
    }
  }
  // C: the smallest items until covered (tmp holds them smallest first), then the largest of them
  // that are no longer needed dropped
  tmp.clear();
  double sum = 0.0;
  for (Index j = k; j-- > 0 && sum < excess;) tmp.push_back(j), sum += w[desc[j]];
  for (size_t t = tmp.size(); t-- > 0;) {
    if (sum - w[desc[tmp[t]]] >= excess) sum -= w[desc[tmp[t]]], tmp[t] = -1;
  }
  if (sum >= excess && sum < best) {
    out.clear();
    for (size_t t = tmp.size(); t-- > 0;)
      if (tmp[t] >= 0) out.push_back(tmp[t]);
  }
}

// Heaviest first, ties by index (weights grow with lengths: lengths descending).
bool heavier(const ShedItem& a, const ShedItem& b) { return a.len > b.len || (a.len == b.len && a.idx < b.idx); }

// `v` heaviest first, ties by index: one radix sort of packed (max - length, index) words where
// they fit in 64 bits and the list is long, a comparison sort otherwise.
void sort_heavier_first(std::vector<ShedItem>& v, std::vector<ShedItem>& tmp, int64_t max_len, Index n) {
  const int idx_bits = bit_width(static_cast<uint64_t>(n));
  const int len_bits = bit_width(static_cast<uint64_t>(max_len));
  if (v.size() < 4096 || idx_bits + len_bits > 64) {
    std::sort(v.begin(), v.end(), heavier);
    return;
  }
  tmp.resize(v.size());
  const ShedItem* sorted = radix_sort(v.data(), tmp.data(), v.size(), idx_bits + len_bits, [&](const ShedItem& x) {
    return (static_cast<uint64_t>(max_len - x.len) << idx_bits) | static_cast<uint64_t>(x.idx);
  });
  if (sorted != v.data()) v.swap(tmp);
}

}  // namespace

// --- BestFit -----------------------------------------------------------------------------------

void BestFit::build(double T, const std::vector<double>& load) {
  T_ = T;
  all_.clear();
  for (Index r = 0; r < static_cast<Index>(load.size()); ++r)
    if (T - load[r] > 0) all_.push_back({T - load[r], r});
  std::sort(all_.begin(), all_.end());
  const size_t chunks = (all_.size() + kChunk - 1) / kChunk;
  chunk_.resize(chunks), last_.resize(chunks);
  for (size_t c = 0; c < chunks; ++c) {
    const auto b = all_.begin() + static_cast<std::ptrdiff_t>(c * kChunk);
    chunk_[c].assign(b, b + static_cast<std::ptrdiff_t>(std::min(kChunk, all_.size() - c * kChunk)));
    last_[c] = chunk_[c].back();
  }
}

// First position in a[0, n) whose entry is not below x (n if none). Branch-free: the searches
// of the best fit are unpredictable, and a mispredicted branch per step costs more than the step.
template <class T>
size_t first_not_below(const T* a, size_t n, const T& x) {
  if (n == 0) return 0;
  const T* base = a;
  while (n > 1) {
    const size_t half = n / 2;
    base = base[half - 1] < x ? base + half : base;
    n -= half;
  }
  return static_cast<size_t>(base - a) + (*base < x ? 1 : 0);
}

size_t BestFit::chunk_of(const Entry& e) const {
  const size_t c = first_not_below(last_.data(), last_.size(), e);
  return std::min(c, last_.size() - 1);
}

Index BestFit::find(double w, Pos& pos) const {
  const Entry probe{w, std::numeric_limits<Index>::min()};
  pos.chunk = first_not_below(last_.data(), last_.size(), probe);
  if (pos.chunk == last_.size()) return -1;
  const auto& ch = chunk_[pos.chunk];
  pos.at = first_not_below(ch.data(), ch.size(), probe);
  return ch[pos.at].rank;
}

void BestFit::lower(const Pos& pos, double free) {
  auto& ch = chunk_[pos.chunk];
  const Entry e{free, ch[pos.at].rank};
  if (free > 0 && (pos.chunk == 0 || last_[pos.chunk - 1] < e)) {
    // still in this chunk: shift the entries between its new and old place up by one
    const size_t to = first_not_below(ch.data(), pos.at, e);
    std::move_backward(ch.begin() + static_cast<std::ptrdiff_t>(to), ch.begin() + static_cast<std::ptrdiff_t>(pos.at),
                       ch.begin() + static_cast<std::ptrdiff_t>(pos.at + 1));
    ch[to] = e;
    last_[pos.chunk] = ch.back();
    return;
  }
  erase_at(pos.chunk, pos.at);
  if (free > 0) insert(e);
}

Index BestFit::roomiest() const { return last_.empty() ? -1 : last_.back().rank; }

void BestFit::insert(const Entry& e) {
  if (chunk_.empty()) {
    chunk_.assign(1, {e}), last_.assign(1, e);
    return;
  }
  const size_t c = chunk_of(e);
  auto& ch = chunk_[c];
  ch.insert(ch.begin() + static_cast<std::ptrdiff_t>(first_not_below(ch.data(), ch.size(), e)), e);
  last_[c] = ch.back();
  if (ch.size() >= 2 * kChunk) {  // split in halves
    std::vector<Entry> upper(ch.begin() + kChunk, ch.end());
    ch.resize(kChunk);
    last_[c] = ch.back();
    chunk_.insert(chunk_.begin() + static_cast<std::ptrdiff_t>(c + 1), std::move(upper));
    last_.insert(last_.begin() + static_cast<std::ptrdiff_t>(c + 1), chunk_[c + 1].back());
  }
}

void BestFit::erase(const Entry& e) {
  if (chunk_.empty()) return;
  const size_t c = chunk_of(e);
  const auto& ch = chunk_[c];
  const size_t at = first_not_below(ch.data(), ch.size(), e);
  if (at == ch.size() || ch[at].rank != e.rank || ch[at].free != e.free) return;  // not held
  erase_at(c, at);
}

void BestFit::erase_at(size_t c, size_t at) {
  auto& ch = chunk_[c];
  ch.erase(ch.begin() + static_cast<std::ptrdiff_t>(at));
  if (ch.empty()) {
    chunk_.erase(chunk_.begin() + static_cast<std::ptrdiff_t>(c));
    last_.erase(last_.begin() + static_cast<std::ptrdiff_t>(c));
  } else {
    last_[c] = ch.back();
  }
}

void BestFit::update(Index r, double before, double after) {
  const double fb = T_ - before, fa = T_ - after;
  if (fb > 0) erase({fb, r});
  if (fa > 0) insert({fa, r});
}

// --- Placer ------------------------------------------------------------------------------------

void Placer::reset(const double* w, const int64_t* lengths, Index n, Index d, Index per, const Index* src,
                   int64_t max_len) {
  w_ = w, len_ = lengths, n_ = n, d_ = d, per_ = per, src_ = src, max_len_ = max_len;
  rank_major_ = true;
  for (Index i = 1; i < n && rank_major_; ++i) rank_major_ = src[i - 1] <= src[i];
  load0_.assign(d, 0.0);
  if (rank_major_) {
    // a rank's examples are a range: its start, and its load summed in order
    by_src_.start.assign(d + 1, 0);
    for (Index i = 0; i < n; ++i) ++by_src_.start[src[i] + 1];
    for (Index r = 0; r < d; ++r) {
      const Index b = by_src_.start[r], e = b + by_src_.start[r + 1];
      double s = 0.0;
      for (Index i = b; i < e; ++i) s += w[i];
      load0_[r] = s;
      by_src_.start[r + 1] = e;
    }
  } else {
    for (Index i = 0; i < n; ++i) load0_[src[i]] += w[i];
    by_src_.build(src, n, d);
  }
  if (static_cast<Index>(mark_item_.size()) != n) mark_item_.assign(n, 0);  // kept all-zero between calls
  node_of_.resize(d);
  for (Index r = 0; r < d; ++r) node_of_[r] = r / per;
}

void Placer::items_of(Index r, std::vector<Index>& out) const {
  thread_local Scratch s;
  items_of(r, out, s);
}

void Placer::items_of(Index r, std::vector<Index>& out, Scratch& s) const {
  const Index b = by_src_.start[r], e = by_src_.start[r + 1];
  out.resize(e - b);
  for (Index k = b; k < e; ++k) out[k - b] = rank_major_ ? k : by_src_.order[k];
  heaviest_first(out, [&](Index i) { return len_[i]; }, s);
}

// `v` (ids in ascending order of their tie-break) by length descending, ties kept in order. Tens
// of ids (a rank's examples, a node's shed ones) sort by counting, for each, the ids ahead of it:
// branch-free comparisons of packed (max - length, position) words, which vectorize, several
// times faster than a comparison sort at this size. Longer lists take a comparison sort.
template <class Len>
void Placer::heaviest_first(std::vector<Index>& v, Len len, Scratch& s) const {
  const Index k = static_cast<Index>(v.size());
  const int pos_bits = bit_width(static_cast<uint64_t>(k));
  if (k <= 256 && pos_bits + bit_width(static_cast<uint64_t>(max_len_)) <= 31) {
    s.key.resize(k), s.from.assign(v.begin(), v.end());
    for (Index j = 0; j < k; ++j) s.key[j] = static_cast<int32_t>(((max_len_ - len(v[j])) << pos_bits) | j);
    for (Index j = 0; j < k; ++j) {
      const int32_t kj = s.key[j];
      int32_t ahead = 0;
      for (Index t = 0; t < k; ++t) ahead += s.key[t] < kj;
      v[ahead] = s.from[j];
    }
    return;
  }
  s.order.resize(k);
  for (Index j = 0; j < k; ++j) s.order[j] = j;
  s.from.assign(v.begin(), v.end());
  std::stable_sort(s.order.begin(), s.order.end(), [&](Index p, Index q) { return len(s.from[p]) > len(s.from[q]); });
  for (Index j = 0; j < k; ++j) v[j] = s.from[s.order[j]];
}

bool Placer::place(double T, double cut, Index* dst) {
  std::copy(src_, src_ + n_, dst);
  load_ = load0_;
  moved_.clear();
  repaired_.clear();
  // 1. every rank above the cut sheds a near-minimal set, into pool_ in source-rank order
  shed_all(cut);
  if (pool_.empty()) return true;
  // 2. by node: what a node cannot hold goes off-node, spread over its shedding ranks; the rest
  //    is placed on the node (home first); what finds no room there joins remote_
  remote_.clear();
  if (per_ < d_) {
    place_on_nodes(T, dst);
  } else {
    remote_ = pool_;
  }
  // 3. the rest, heaviest first: home if it has room, else best fit on the home node, else best
  //    fit anywhere
  sort_heavier_first(remote_, sort_tmp_, max_len_, n_);
  free_.build(T, load_);
  overflow_ = false;
  for (const ShedItem& it : remote_) put(it, T, dst);
  // 4. repair rounds: a rank that overflowed sheds again, the shed examples go elsewhere
  for (int round = 0; overflow_ && round < 16; ++round) repair(T, dst);
  for (Index r = 0; r < d_; ++r)
    if (load_[r] > T) return false;
  for (const ShedItem& it : pool_)
    if (dst[it.idx] != it.src) moved_.push_back(it.idx);
  if (!repaired_.empty()) {  // examples shed again: each once, in addition to the first-round ones
    for (Index i : moved_) mark_item_[i] = 1;
    for (Index i : repaired_)
      if (dst[i] != src_[i] && !mark_item_[i]) moved_.push_back(i), mark_item_[i] = 1;
    for (Index i : moved_) mark_item_[i] = 0;
  }
  return true;
}

// Ranks [r0, r1) above the cut shed a near-minimal set each, heaviest first, into s.pool.
void Placer::shed_range(Index r0, Index r1, double cut, Scratch& s) {
  s.pool.clear();
  for (Index r = r0; r < r1; ++r) {
    if (load_[r] <= cut) continue;
    items_of(r, s.desc, s);
    shed_set(s.desc.data(), static_cast<Index>(s.desc.size()), w_, load_[r] - cut, s.chosen, s.tmp);
    for (Index j : s.chosen) {
      const Index i = s.desc[j];
      s.pool.push_back({i, r, len_[i], w_[i]});
      load_[r] -= w_[i];
    }
  }
}

// Ranks are independent, so large problems split them over two threads (each keeps rank order,
// so the result does not depend on the split).
void Placer::shed_all(double cut) {
  if (n_ < 100000 || d_ < 64) {
    shed_range(0, d_, cut, main_);
    pool_.swap(main_.pool);
    return;
  }
  const Index mid = d_ / 2;
  run_beside([&] { shed_range(mid, d_, cut, second_); }, [&] { shed_range(0, mid, cut, main_); });
  pool_.swap(main_.pool);
  pool_.insert(pool_.end(), second_.pool.begin(), second_.pool.end());
}

// pool_ is in source-rank order, so each node's shed examples are one range of it. Nodes are
// independent here (each touches only its own ranks and examples), so large problems split them
// over two threads at a node boundary; the remote lists are concatenated in node order.
void Placer::place_on_nodes(double T, Index* dst) {
  const Index P = static_cast<Index>(pool_.size());
  off_node_.assign(P, 0);
  if (n_ < 100000 || P < 2) {
    place_nodes_range(0, P, T, dst, main_);
    remote_.swap(main_.remote);
    return;
  }
  Index mid = P / 2;
  while (mid < P && node_of_[pool_[mid].src] == node_of_[pool_[mid - 1].src]) ++mid;
  run_beside([&] { place_nodes_range(mid, P, T, dst, second_); }, [&] { place_nodes_range(0, mid, T, dst, main_); });
  remote_.swap(main_.remote);
  remote_.insert(remote_.end(), second_.remote.begin(), second_.remote.end());
}

// The nodes whose shed examples are pool_[p0, p1), into s.remote what must leave its node.
void Placer::place_nodes_range(Index p0, Index p1, double T, Index* dst, Scratch& s) {
  s.remote.clear();
  for (Index p = p0; p < p1;) {
    const Index node = node_of_[pool_[p].src];
    Index q = p;
    double shed = 0.0, room = 0.0;
    for (; q < p1 && node_of_[pool_[q].src] == node; ++q) shed += pool_[q].w;
    for (Index r = node * per_; r < (node + 1) * per_; ++r) room += std::max(0.0, T - load_[r]);
    if (shed - room > 0) send_off_node(p, q, node, shed - room, s);
    // the others heaviest first (ties by position: source rank, then index): home if it has
    // room, else best fit on the node
    s.desc.clear();
    for (Index k = p; k < q; ++k)
      if (!off_node_[k]) s.desc.push_back(k);
    heaviest_first(s.desc, [&](Index k) { return pool_[k].len; }, s);
    for (Index k : s.desc) {
      const ShedItem& it = pool_[k];
      const Index to = T - load_[it.src] >= it.w ? it.src : best_in_node(node, it.w, T);
      if (to < 0) {
        off_node_[k] = 1;  // no room on its node after all
        continue;
      }
      dst[it.idx] = to;
      load_[to] += it.w;
    }
    for (Index k = p; k < q; ++k)
      if (off_node_[k]) s.remote.push_back(pool_[k]);
    p = q;
  }
}

// Marks (off_node_) shed examples of pool_[p, q) (one node's, by rank, heaviest first) that leave
// the node, `need` in all: the shedding rank with the least off-node volume so far sends its
// largest example that does not overshoot the need (else its smallest).
void Placer::send_off_node(Index p, Index q, Index node, double need, Scratch& s) {
  const Index first = node * per_;
  auto& end = s.rank_end;  // rank first+u's examples: pool_[end[u], end[u+1])
  end.assign(per_ + 1, p);
  for (Index k = p; k < q; ++k) end[pool_[k].src - first + 1] = k + 1;
  for (Index u = 1; u <= per_; ++u) end[u] = std::max(end[u], end[u - 1]);
  auto& off = s.off;
  off.assign(per_, 0.0);
  auto& left = s.left;  // examples not yet sent, per rank
  left.resize(per_);
  for (Index u = 0; u < per_; ++u) left[u] = end[u + 1] - end[u];
  while (need > 0) {
    Index pick = -1;
    for (Index u = 0; u < per_; ++u)
      if (left[u] > 0 && (pick < 0 || off[u] < off[pick])) pick = u;
    if (pick < 0) break;
    const Index b = end[pick], e = end[pick + 1];
    Index best = -1;
    for (Index k = b; k < e && best < 0; ++k)
      if (!off_node_[k] && pool_[k].w <= need) best = k;
    for (Index k = e; best < 0 && k-- > b;)
      if (!off_node_[k]) best = k;
    off_node_[best] = 1, --left[pick];
    off[pick] += pool_[best].w;
    need -= pool_[best].w;
  }
}

Index Placer::best_in_node(Index node, double w, double T) const {
  Index best = -1;
  double best_free = kInf;
  for (Index r = node * per_; r < (node + 1) * per_; ++r) {
    const double f = T - load_[r];
    if (f >= w && f < best_free) best = r, best_free = f;
  }
  return best;
}

void Placer::put(const ShedItem& it, double T, Index* dst) {
  Index to = -1;
  if (T - load_[it.src] >= it.w) {
    to = it.src;
  } else if (per_ < d_) {
    to = best_in_node(node_of_[it.src], it.w, T);
  }
  BestFit::Pos pos;
  bool found = false;
  if (to < 0) found = (to = free_.find(it.w, pos)) >= 0;
  if (to < 0) {
    // fits nowhere: the rank with the most room takes it, a repair round sheds again
    to = free_.roomiest();
    if (to < 0) to = static_cast<Index>(std::min_element(load_.begin(), load_.end()) - load_.begin());
    overflow_ = true;
  }
  dst[it.idx] = to;
  const double before = load_[to];
  load_[to] += it.w;
  if (found) {
    free_.lower(pos, T - load_[to]);
  } else {
    free_.update(to, before, load_[to]);
  }
}

// Every overloaded rank sheds a near-minimal set of what it holds now; the shed examples are
// placed again, heaviest first.
void Placer::repair(double T, Index* dst) {
  overflow_ = false;
  std::vector<Index> over, slot(d_, -1);
  for (Index r = 0; r < d_; ++r)
    if (load_[r] > T) slot[r] = static_cast<Index>(over.size()), over.push_back(r);
  if (over.empty()) return;
  std::vector<std::vector<Index>> on(over.size());
  for (Index i = 0; i < n_; ++i)
    if (slot[dst[i]] >= 0) on[slot[dst[i]]].push_back(i);
  std::vector<ShedItem> again;
  for (size_t k = 0; k < over.size(); ++k) {
    const Index r = over[k];
    auto& desc = on[k];  // in index order
    heaviest_first(desc, [&](Index i) { return len_[i]; }, main_);
    shed_set(desc.data(), static_cast<Index>(desc.size()), w_, load_[r] - T, main_.chosen, main_.tmp);
    for (Index j : main_.chosen) {
      const Index i = desc[j];
      again.push_back({i, src_[i], len_[i], w_[i]});
      const double before = load_[r];
      load_[r] -= w_[i];
      free_.update(r, before, load_[r]);
    }
  }
  sort_heavier_first(again, sort_tmp_, max_len_, n_);
  for (const ShedItem& it : again) put(it, T, dst), repaired_.push_back(it.idx);
}

}  // namespace mmb
