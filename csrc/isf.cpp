// ISF: iterative sampling and filtering into balanced mini-batches (OmniBal section 4.1, algs. 1-2).
//
// Sampling walks a random permutation of the remaining samples and closes a group when the next
// sample would push the vision total past Q_v or the text total past Q_t. Filtering keeps the
// groups that reach Q'_v or Q'_t and returns the others' samples to the pool. After the last
// iteration the pool is grouped once more: by best-fit-decreasing (default; tighter groups than
// one more random pass) or by plain sampling as in the paper's code. A sample larger than a cap
// becomes a group of its own (the paper's code drops it).
#include <algorithm>
#include <map>
#include <numeric>

#include "schedulers.hpp"

namespace mmb {

namespace {

uint64_t splitmix64(uint64_t& x) {
  uint64_t z = (x += 0x9e3779b97f4a7c15ULL);
  z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ULL;
  z = (z ^ (z >> 27)) * 0x94d049bb133111ebULL;
  return z ^ (z >> 31);
}

}  // namespace

std::vector<Index> permutation(Index n, uint64_t seed) {
  std::vector<Index> p(n);
  std::iota(p.begin(), p.end(), Index{0});
  uint64_t state = seed;
  for (Index i = n - 1; i > 0; --i) {
    const Index j = static_cast<Index>(splitmix64(state) % static_cast<uint64_t>(i + 1));
    std::swap(p[i], p[j]);
  }
  return p;
}

std::vector<Index> isf_groups(const int64_t* vision, const int64_t* text, Index n, const IsfParams& prm,
                              Index* num_groups, Index* num_leftover) {
  std::vector<Index> group(n, -1);
  Index next = 0;
  std::vector<Index> pool;
  pool.reserve(n);
  for (Index i = 0; i < n; ++i) {
    if (vision[i] > prm.max_vision || text[i] > prm.max_text) {
      group[i] = next++;
    } else {
      pool.push_back(i);
    }
  }
  std::vector<Index> members;  // current group
  for (Index it = 0; it < prm.iterations && !pool.empty(); ++it) {
    const uint64_t seed = prm.seed * 0x100000001b3ULL + static_cast<uint64_t>(it);
    const auto perm = permutation(static_cast<Index>(pool.size()), seed);
    std::vector<Index> back;
    auto close = [&](int64_t iv, int64_t itx) {
      if (members.empty()) return;
      if (iv >= prm.min_vision || itx >= prm.min_text) {
        for (Index i : members) group[i] = next;
        ++next;
      } else {
        back.insert(back.end(), members.begin(), members.end());
      }
      members.clear();
    };
    int64_t iv = 0, itx = 0;
    for (Index q : perm) {
      const Index i = pool[q];
      if (!members.empty() && (iv + vision[i] > prm.max_vision || itx + text[i] > prm.max_text)) {
        close(iv, itx);
        iv = itx = 0;
      }
      members.push_back(i);
      iv += vision[i];
      itx += text[i];
    }
    close(iv, itx);
    std::sort(back.begin(), back.end());
    pool.swap(back);
  }
  *num_leftover = static_cast<Index>(pool.size());
  if (!pool.empty()) {
    if (prm.pack_leftovers) {
      // best-fit-decreasing by vision room (text as a second check), on the larger of the two fill
      // fractions; a bin leaves the open set once it reaches a target
      const double qv = static_cast<double>(std::max<int64_t>(prm.max_vision, 1));
      const double qt = static_cast<double>(std::max<int64_t>(prm.max_text, 1));
      std::vector<double> key(n, 0.0);
      for (Index i : pool) key[i] = std::max(vision[i] / qv, text[i] / qt);
      std::stable_sort(pool.begin(), pool.end(), [&](Index a, Index b) { return key[a] > key[b]; });
      struct Bin {
        int64_t v, t;
      };
      std::vector<Bin> bins;
      std::vector<Index> bin_group;
      std::multimap<int64_t, Index> open;  // vision room -> bin, in creation order for equal room
      for (Index i : pool) {
        auto it = open.lower_bound(vision[i]);
        for (; it != open.end(); ++it)
          if (bins[it->second].t + text[i] <= prm.max_text) break;
        Index b;
        if (it == open.end()) {
          b = static_cast<Index>(bins.size());
          bins.push_back({0, 0});
          bin_group.push_back(next++);
        } else {
          b = it->second;
          open.erase(it);
        }
        bins[b].v += vision[i];
        bins[b].t += text[i];
        group[i] = bin_group[b];
        if (!(bins[b].v >= prm.min_vision || bins[b].t >= prm.min_text))
          open.insert({prm.max_vision - bins[b].v, b});
      }
    } else {
      const auto perm = permutation(static_cast<Index>(pool.size()), prm.seed * 0x100000001b3ULL + 0xffffULL);
      int64_t iv = 0, itx = 0;
      bool any = false;
      for (Index q : perm) {
        const Index i = pool[q];
        if (any && (iv + vision[i] > prm.max_vision || itx + text[i] > prm.max_text)) {
          ++next;
          iv = itx = 0;
        }
        group[i] = next;
        any = true;
        iv += vision[i];
        itx += text[i];
      }
      if (any) ++next;
    }
  }
  *num_groups = next;
  return group;
}

}  // namespace mmb
