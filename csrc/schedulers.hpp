// Planners beyond post-balancing: dynamic context-parallel groups (DHP), microbatch reordering
// (DistTrain / MMScale), ISF mini-batches and balanced pipeline partitions (OmniBal), and adaptive
// resource allocation (MMScale).
//
// Same rules as costs.hpp: plain C++17 on arrays, no Python, no torch; deterministic pure
// functions (ties by index, one fixed order of floating-point work), so every process computes
// byte-identical plans.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "costs.hpp"

namespace mmb {

// --- cost of one context-parallel group (DHP eqs. 7-10) -----------------------------------

// Time of a group of packed sequences with s1 = sum l, s2 = sum l^2 on `d` ranks of a ring:
//   fixed + linear * s1 / d + combine(attn * s2 / d, ring * s1 * (d-1)/d + ring_latency * (d-1))
// where combine is max (ring communication hidden under attention, eq. 10) or + (no overlap).
// `attn` already holds the mask factor (1 + eta) of eq. 8. An empty group costs 0.
struct CpCost {
  double linear = 1.0;
  double attn = 0.0;
  double ring = 0.0;
  double ring_latency = 0.0;
  double fixed = 0.0;
  bool overlap = true;

  double time(double s1, double s2, Index count, Index d) const {
    if (count == 0) return 0.0;
    const double dd = static_cast<double>(d);
    const double a = attn * s2 / dd;
    const double c = d > 1 ? ring * s1 * (dd - 1.0) / dd + ring_latency * (dd - 1.0) : 0.0;
    return fixed + linear * s1 / dd + (overlap ? (a > c ? a : c) : a + c);
  }
};

struct CpResult {
  std::vector<Index> group_of;     // [n] group of each sequence
  std::vector<Index> degree;       // [g]
  std::vector<Index> rank_offset;  // [g + 1] into `ranks`
  std::vector<Index> ranks;        // rank ids of every group, concatenated
  std::vector<double> time;        // [g]
  double makespan = 0.0;
  double static_makespan = -1.0;   // best static uniform degree (-1: none feasible)
  Index static_degree = 0;
  double paper_makespan = -1.0;    // best-fit-decreasing + optimal degrees (-1: infeasible)
  double lower_bound = 0.0;        // no schedule is faster
  std::string method;              // which candidate won
};

// Minimum degree of a sequence: ceil(l / mem), at least 1.
Index min_degree(int64_t l, int64_t mem);

// DHP section 4.3 stage 1: memory-aware best-fit-decreasing atomic groups. Returns group of each
// sequence; `dmin` receives each group's minimum degree.
std::vector<Index> bfd_groups(const int64_t* lengths, Index n, int64_t mem, std::vector<Index>& dmin);

// Exact min-max degrees for fixed groups: the smallest makespan tau such that
// sum_k min{d >= dmin_k : T_k(d) <= tau} <= num_ranks, by binary search over the candidate values.
// `table` is row-major [g][num_ranks + 1] (column d = time on d ranks; columns < dmin ignored).
// Returns the degrees (empty if sum dmin > num_ranks); same optimum as the paper's 2-D DP.
std::vector<Index> optimal_degrees(const double* table, Index g, Index num_ranks, const Index* dmin,
                                   double* makespan);

// DHP algorithm 1 (the 2-D DP, O(g N^2)), for reference and benchmarks.
std::vector<Index> paper_dp_degrees(const double* table, Index g, Index num_ranks, const Index* dmin,
                                    double* makespan);

// The full scheduler: candidates (paper, every static uniform degree, locally improved) under
// `cost`; the best is returned with ranks laid out (node-aware if ranks_per_node > 0). `extra`
// ([n] or null): each sequence's further seconds, spread over its group's ranks (a group of degree
// d adds the sum of its sequences' extra over d: their media encoded by the group's members).
CpResult cp_schedule(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                     Index ranks_per_node, Index max_rounds, const double* extra = nullptr);

// The same scheduler on a table of per-sequence times, cost[i * num_ranks + d - 1] = sequence i
// alone on d ranks (a group takes the sum over its sequences: a vectorized user cost).
CpResult cp_schedule_table(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const double* cost,
                           Index ranks_per_node, Index max_rounds);

// The greedy grouping of one static degree under the closed-form cost (and `extra`, as in
// cp_schedule; empty if a sequence fits nowhere); its makespan in *makespan.
std::vector<Index> cp_static_groups(const int64_t* lengths, Index n, Index num_ranks, int64_t mem, const CpCost& cost,
                                    Index degree, double* makespan, const double* extra = nullptr);

// Ranks of groups with the given degrees: contiguous, and inside one node when a group fits one.
void layout_ranks(const std::vector<Index>& degree, Index num_ranks, Index ranks_per_node,
                  std::vector<Index>& offset, std::vector<Index>& ranks);

// --- 1F1B simulation and microbatch reordering (DistTrain section 6.1-6.2) ------------------------

// Makespan of a 1F1B pipeline: fwd/bwd are row-major [l][p] (microbatch, stage) in execution
// order. Each op starts when the previous op on its stage and its dependency (the forward on the
// stage before, the backward on the stage after) have ended. If fstart/bstart are given ([l][p])
// they receive the start times.
double simulate_1f1b(const double* fwd, const double* bwd, Index l, Index p, double* fstart = nullptr,
                     double* bstart = nullptr);

// Equal-count partition of n samples into m groups minimizing the largest sum of `w` (sizes follow
// numpy.array_split: the first n % m groups hold one more). Returns the group of each sample.
std::vector<Index> balanced_count_groups(const double* w, Index n, Index m, Index max_iters);

// DistTrain algorithm 2 as written (ascending sort, least-loaded group, concatenated), then
// split into equal-count consecutive blocks as a data loader does. Returns the order.
std::vector<Index> paper_intra_order(const double* w, Index n, Index m);

// DistTrain algorithm 3 on microbatches with times fwd/bwd [l][p]: returns an order.
std::vector<Index> paper_inter_order(const double* fwd, const double* bwd, Index l, Index p);

// Our inter-microbatch order: the best of the original, the paper's and sorted seeds, improved by
// simulated swap/insert moves. Never simulates slower than the original or the paper's order.
std::vector<Index> inter_order(const double* fwd, const double* bwd, Index l, Index p, Index max_evals);

// Every block [offsets[k], offsets[k+1]) of `order` (rows of fwd/bwd [n][p]) is one DP group's
// microbatches: returns `order` with each block in our order (method 0), the paper's (1), or ours
// without the paper's order among the seeds (2: when the caller compares with the paper itself).
// Ours: the best seed for every block, then local search on the slowest block while it stays the
// slowest (the makespan is the slowest block's time), max_evals simulations per searched block.
// `times` (if given) receives every block's simulated time in the new order.
std::vector<Index> reorder_blocks(const double* fwd, const double* bwd, Index p, const Index* order,
                                  const Index* offsets, Index groups, int method, Index max_evals,
                                  std::vector<double>* times = nullptr);

// 1F1B makespan of every block of `order`.
std::vector<double> simulate_blocks(const double* fwd, const double* bwd, Index p, const Index* order,
                                    const Index* offsets, Index groups);

// --- ISF mini-batches (OmniBal section 4.1) -------------------------------------------------------

struct IsfParams {
  int64_t max_vision = 0;  // Q_v
  int64_t max_text = 0;    // Q_t
  int64_t min_vision = 0;  // Q'_v
  int64_t min_text = 0;    // Q'_t
  Index iterations = 10;
  uint64_t seed = 0;
  bool pack_leftovers = true;  // first-fit-decreasing for what is left after the iterations
};

// Groups (packed mini-batches) as group id per sample (-1: dropped, larger than a cap).
std::vector<Index> isf_groups(const int64_t* vision, const int64_t* text, Index n, const IsfParams& prm,
                              Index* num_groups, Index* num_leftover);

// A seeded permutation (splitmix64 + Fisher-Yates), identical on every platform.
std::vector<Index> permutation(Index n, uint64_t seed);

// --- pipeline partition (OmniBal section 4.2) and resource allocation (MMScale section 4.3) -----------

// Boundaries b[1..N-1] (stage i = layers [b[i-1], b[i])) of the partition minimizing
//   sum_i (S_i - mean)^2 + comm_weight * sum_i act[b_i - 1]
// over all partitions into `stages` non-empty stages (exact DP, O(N L^2)).
std::vector<Index> partition_dp(const double* fwd, const double* act, Index L, Index stages,
                                double comm_weight);

// The paper's greedy anchor: cut when the running sum reaches the next multiple of total / N.
std::vector<Index> partition_greedy(const double* fwd, Index L, Index stages);

// Smallest bottleneck partition (exact DP), the "profile-based" method of OmniBal table 6.
std::vector<Index> partition_minmax(const double* fwd, Index L, Index stages);

// MMScale section 4.3 / DistTrain section 5.1-5.2: one module (encoder, LLM backbone, generator) of a
// disaggregated multimodal model. time[t]: forward+backward time of the whole module for one sample
// on tp_options[t] GPUs (inf: not allowed); memory terms in bytes (0: ignore memory).
struct ModuleSpec {
  std::vector<double> time;
  double params = 0.0;       // parameters + gradients
  double optimizer = 0.0;    // optimizer states (sharded over all the module's GPUs)
  double activation = 0.0;   // activations of one sample through the whole module
  Index max_pp = 1 << 30;    // e.g. the number of layers
};

struct AllocChoice {
  std::vector<Index> tp, dp, pp;
  double iter_time = 0.0, warmup = 0.0, steady = 0.0;
  Index gpus = 0;
};

// Every TP (from tp_options) and DP (DP_llm | batch, DP_m | DP_llm) choice, each with the exact
// integer PP sizes minimizing the bottleneck stage (greedy on the bottleneck, optimal for this
// separable min-max), ranked by iteration time (warm-up + steady phase, DistTrain eqs. 1, 5).
// Module `llm` is the backbone. Returns the best `top_k`. `relaxed`: the paper's way instead,
// continuous stage counts (the convex relaxation) rounded down.
std::vector<AllocChoice> allocate(const std::vector<ModuleSpec>& modules, Index llm,
                                  const std::vector<Index>& tp_options, Index batch, Index num_gpus, double capacity,
                                  Index top_k, bool relaxed);

}  // namespace mmb
