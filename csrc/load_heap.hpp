// Tournament trees over the ranks' loads, for the greedy planners (internal helper).
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <vector>

#include "costs.hpp"

namespace mmb {

// Tournament (winner) tree over the ranks, keyed by (load, rank): the root holds the least loaded
// rank, and adding load to it replays one leaf-to-root path with one comparison per level. Loads
// and ranks live in two arrays indexed by tree node and each level picks a child by index
// arithmetic (no branch to mispredict), so an LPT step is log2(d) short steps.
class LoadHeap {
 public:
  LoadHeap(Index d, const std::vector<double>& load) {
    size_ = 1;
    while (size_ < d) size_ <<= 1;
    key_.assign(2 * size_, std::numeric_limits<double>::infinity());
    who_.assign(2 * size_, 0);
    for (Index i = 0; i < size_; ++i) {
      key_[size_ + i] = i < d ? load[i] : std::numeric_limits<double>::infinity();
      who_[size_ + i] = static_cast<int32_t>(i);
    }
    for (Index v = size_ - 1; v >= 1; --v) pull(v);
  }
  Index top() const { return who_[1]; }
  // Add `w` to the load of the top rank and restore the tree. The running winner stays in
  // registers on the way up and only the siblings are loaded: their addresses are known in
  // advance and none of them was just stored, so the loads issue in parallel and the dependent
  // chain per level is one compare and two selects.
  void add_to_top(double w) {
    Index v = size_ + who_[1];
    double ck = key_[v] + w;
    int32_t cw = who_[v];
    key_[v] = ck;
    for (; v > 1; v >>= 1) {
      const Index sib = v ^ 1;
      const double sk = key_[sib];
      // the left child holds the lower ranks and wins ties
      const bool take = (sk < ck) | (static_cast<bool>(v & 1) & (sk == ck));
      const int32_t sw = who_[sib];
      ck = take ? sk : ck;
      cw = take ? sw : cw;
      key_[v >> 1] = ck;
      who_[v >> 1] = cw;
    }
  }

 private:
  // The left child holds the lower ranks, so on equal loads the left (lower rank) wins.
  void pull(Index v) {
    const Index c = 2 * v + static_cast<Index>(key_[2 * v + 1] < key_[2 * v]);
    key_[v] = key_[c];
    who_[v] = who_[c];
  }
  Index size_ = 1;
  std::vector<double> key_;
  std::vector<int32_t> who_;
};

// The tournament tree for integral loads of at most 2^16 ranks: a node is the single word
// (load << 16 | rank), which orders exactly like (load, rank).
class PackedLoadHeap {
 public:
  explicit PackedLoadHeap(Index d) {
    size_ = 1;
    while (size_ < d) size_ <<= 1;
    node_.assign(2 * size_, ~uint64_t{0});
    for (Index i = 0; i < d; ++i) node_[size_ + i] = static_cast<uint64_t>(i);
    for (Index v = size_ - 1; v >= 1; --v) node_[v] = std::min(node_[2 * v], node_[2 * v + 1]);
  }
  Index top() const { return static_cast<Index>(node_[1] & 0xffff); }
  void add_to_top(uint64_t w) {
    Index v = size_ + top();
    uint64_t cur = node_[v] + (w << 16);
    node_[v] = cur;
    for (; v > 1; v >>= 1) {
      cur = std::min(cur, node_[v ^ 1]);
      node_[v >> 1] = cur;
    }
  }

 private:
  Index size_ = 1;
  std::vector<uint64_t> node_;
};

}  // namespace mmb
