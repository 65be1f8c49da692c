// The placement step of locality-aware balancing (internal to locality.cpp and placer.cpp).
//
// Given a target makespan T, every rank above T sheds a near-minimal set of its own examples,
// and the shed examples fill the free capacity below T: home first, then the home node, then the
// best fit anywhere. Built for 10^4 ranks x 10^2 examples: the examples of ranks at or below T are
// never visited, the shed ones are copied once into a compact array (in source-rank order, so
// every later pass reads memory in order), and the free capacity is searched in sorted chunks.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "costs.hpp"
#include "csr.hpp"

namespace mmb {

// An example that left its rank's batch, with what placing it needs.
struct ShedItem {
  Index idx;    // example
  Index src;    // its source rank
  int64_t len;  // its length (orders examples: weights grow with lengths)
  double w;     // its weight
};

// Ranks with free capacity below a fixed target, searchable for the best fit: the least free
// capacity that still holds a weight, ties to the lowest rank. The (free, rank) entries are kept
// sorted in short chunks under a directory of each chunk's last entry, so a search is two binary
// searches over contiguous memory and an update moves at most one chunk's entries (a balanced
// tree does the same in as many cache misses as it has levels, and allocates on every update).
class BestFit {
 public:
  void build(double T, const std::vector<double>& load);
  struct Pos {
    size_t chunk = 0, at = 0;
  };
  // best-fitting rank for weight w (its entry at `pos`), or -1
  Index find(double w, Pos& pos) const;
  // the entry at `pos` (from find) now has `free` capacity, less than before
  void lower(const Pos& pos, double free);
  // rank with the most free capacity, or -1 if none has any
  Index roomiest() const;
  // rank r's load changed from `before` to `after`
  void update(Index r, double before, double after);

 private:
  struct Entry {
    double free;
    Index rank;
    bool operator<(const Entry& o) const { return free < o.free || (free == o.free && rank < o.rank); }
  };
  static constexpr size_t kChunk = 64;  // a chunk splits when it reaches twice this
  size_t chunk_of(const Entry& e) const;  // first chunk whose last entry is >= e (or the last chunk)
  void insert(const Entry& e);
  void erase(const Entry& e);
  void erase_at(size_t chunk, size_t at);

  double T_ = 0.0;
  std::vector<std::vector<Entry>> chunk_;
  std::vector<Entry> last_;  // last entry of each chunk
  std::vector<Entry> all_;   // scratch of build
};

class Placer {
 public:
  // `w`: per-example weights (kept by pointer, as are `lengths` and `src`); `per` ranks per node.
  void reset(const double* w, const int64_t* lengths, Index n, Index d, Index per, const Index* src,
             int64_t max_len);

  // One placement at target T; ranks above `cut` (<= T) shed down to it first. Writes the plan to
  // `dst` (n entries) and returns whether every rank ends at or below T.
  bool place(double T, double cut, Index* dst);

  // The examples sampled on rank r, heaviest first (ties by index), into `out`.
  void items_of(Index r, std::vector<Index>& out) const;

  const std::vector<double>& source_loads() const { return load0_; }
  const std::vector<double>& loads() const { return load_; }
  const std::vector<Index>& node_of() const { return node_of_; }
  // examples the last placement moved off their source rank
  const std::vector<Index>& moved() const { return moved_; }

 private:
  struct Scratch {  // one per thread
    std::vector<Index> desc, chosen, tmp, from, order, rank_end, left;
    std::vector<int32_t> key;
    std::vector<double> off;
    std::vector<ShedItem> pool, remote;
  };
  void items_of(Index r, std::vector<Index>& out, Scratch& s) const;
  template <class Len>
  void heaviest_first(std::vector<Index>& v, Len len, Scratch& s) const;
  void shed_range(Index r0, Index r1, double cut, Scratch& s);
  void shed_all(double cut);
  void place_on_nodes(double T, Index* dst);
  void place_nodes_range(Index p0, Index p1, double T, Index* dst, Scratch& s);
  void send_off_node(Index p, Index q, Index node, double need, Scratch& s);
  Index best_in_node(Index node, double w, double T) const;
  void put(const ShedItem& it, double T, Index* dst);
  void repair(double T, Index* dst);

  const double* w_ = nullptr;
  const int64_t* len_ = nullptr;
  const Index* src_ = nullptr;
  Index n_ = 0, d_ = 0, per_ = 1;
  int64_t max_len_ = 0;
  bool rank_major_ = true, overflow_ = false;
  Csr by_src_;
  std::vector<double> load0_, load_;
  std::vector<Index> node_of_, moved_, repaired_;
  std::vector<ShedItem> pool_, remote_, sort_tmp_;
  std::vector<char> off_node_, mark_item_;
  Scratch main_, second_;
  BestFit free_;
};

}  // namespace mmb
