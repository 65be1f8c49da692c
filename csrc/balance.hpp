// Post-balancing planners (OrchMLLM section 5.1 and appendix A, and improvements on them).
//
// Everything here is plain C++17 on arrays of example lengths: no Python, no torch. Every function
// is a deterministic pure function of its inputs: ties are broken by index, floating-point work is
// done in one fixed order, so every process that calls it computes byte-identical plans.
#pragma once

#include <cstdint>
#include <vector>

namespace mmb {

// Cost of one batch with lengths l_1..l_b: Sum = sum l; Padded = b * max l; Quadratic =
// alpha * sum l + beta * sum l^2; Conv = alpha * sum l + beta * b * (max l)^2; PaddedQuadratic =
// alpha * b * max l + beta * b * (max l)^2 (a padded transformer: OrchMLLM eq. 2, padding case).
enum class Policy : int { Sum = 0, Padded = 1, Quadratic = 2, Conv = 3, PaddedQuadratic = 4 };

struct CostModel {
  Policy policy = Policy::Sum;
  double alpha = 1.0;
  double beta = 0.0;
};

using Index = int64_t;

// Indices 0..n-1 sorted by length descending, ties by index ascending (LSD radix sort, O(n)).
std::vector<Index> order_by_length_desc(const int64_t* lengths, Index n);
void order_by_length_desc(const int64_t* lengths, Index n, std::vector<Index>& order);

// Additive per-example weight for the "sum" and "quadratic" policies.
double item_weight(int64_t length, const CostModel& cm);

// Cost of every rank's batch under `cm` given the destination of each example.
std::vector<double> batch_costs(const int64_t* lengths, Index n, const Index* dst, Index num_ranks,
                                const CostModel& cm);

// Plain balancing (no source information): destination rank of each example.
std::vector<Index> balance(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm);

// --- building blocks, exposed for tests and benchmarks --------------------------------------

// OrchMLLM algorithm 1 (LPT on `weights`, items visited in `order`).
std::vector<Index> lpt(const double* weights, const std::vector<Index>& order, Index num_ranks);

// Move/swap local search between the most and least loaded ranks; never raises the makespan.
void refine_additive(const double* weights, Index n, Index num_ranks, std::vector<Index>& dst,
                     Index max_iters);

// General local search under any cost model (used for "conv"); never raises the makespan.
// `order`: the examples by length descending, ties by index, if the caller has it.
void refine_general(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                    std::vector<Index>& dst, Index max_iters, const std::vector<Index>* order = nullptr);

// A lower bound on the makespan refine_general reaches from `dst` in `max_iters` steps: a step
// changes two ranks, so one of the 2 max_iters + 1 costliest keeps its cost. -inf when every rank
// may change.
double refine_floor(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                    const std::vector<Index>& dst, Index max_iters);

// Exact min-max "padded" partition (count * max length) into at most num_ranks groups.
std::vector<Index> padded_optimal(const int64_t* lengths, Index n, Index num_ranks);

// OrchMLLM algorithm 2 (ascending greedy + binary search), for reference and benchmarks.
std::vector<Index> paper_padded(const int64_t* lengths, Index n, Index num_ranks);

// OrchMLLM algorithm 5 (long sequences grouped under the sum bound, the rest by LPT).
// `order` (lengths descending, ties by index) and `lpt_sums` (LPT on the lengths in that order),
// if the caller has them.
std::vector<Index> paper_conv(const int64_t* lengths, Index n, Index num_ranks,
                              const std::vector<Index>* order = nullptr, const std::vector<Index>* lpt_sums = nullptr);

double max_cost(const int64_t* lengths, Index n, const std::vector<Index>& dst, Index num_ranks,
                const CostModel& cm);

// --- exact and near-exact plain planners (search.cpp) ----------------------------------------

// Cost of one batch from its sums: `sum` of lengths, `sq` of squared lengths, `count`, `mx` largest.
double batch_cost(const CostModel& cm, double sum, double sq, double count, double mx);

// Exact min-max partition for a batch cost count * h(max length) ("padded", "padded_quadratic").
std::vector<Index> padded_general_optimal(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm);

// "conv" from its candidates (the paper's algorithm 5, LPT, the best runs, the padded optimum),
// each refined by `iters` local-search steps: destination of each example.
std::vector<Index> balance_conv(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm, Index iters);

// Optimal partition of the length-sorted order into at most num_ranks runs (a "conv" candidate).
// Within 2^-20 of the optimum over such partitions. `order`: as for paper_conv.
std::vector<Index> conv_runs(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                             const std::vector<Index>* order = nullptr);

// Largest differencing (Karmarkar-Karp) on additive weights: destination of each example.
std::vector<Index> largest_differencing(const double* weights, Index n, Index num_ranks);

// Branch and bound for a plan strictly better than `dst` within `budget` nodes; replaces `dst` and
// returns true if it finds one. Deterministic (the budget counts nodes, not time).
bool improve_small(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm, std::vector<Index>& dst,
                   int64_t budget);

// --- locality (locality.cpp) ----------------------------------------------------------------

// Examples of equal length are interchangeable: swapping their destinations leaves every rank's
// batch, and so every policy's cost, as it was. Within each length, examples go home first where
// their source rank holds one of the length's places, then to a place left on their source's
// node (`ranks_per_node` ranks each), then to any (examples in index order, places in the order
// first seen): the most examples any such exchange keeps home, then the most of the others on
// their node. Rewrites `dst`.
void keep_equal_lengths_home(const int64_t* lengths, Index n, Index num_ranks, const Index* src,
                             Index ranks_per_node, Index* dst);

// Balancing that keeps examples on their source rank unless moving them is needed to reach the
// makespan of `balance`, and prefers destinations on the source's node.
// Writes the destination of each example to `dst` (n entries).
void balance_local(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm, const Index* src,
                   Index ranks_per_node, double tolerance, Index* dst);

// Assign whole groups (dst of a plain plan) to ranks maximizing the tokens that stay on their
// source rank, then on their source node. Returns group -> rank.
std::vector<Index> assign_groups(const int64_t* lengths, Index n, const Index* group, const Index* src,
                                 Index num_ranks, Index ranks_per_node);

// --- node-wise permutation (node_perm.cpp), OrchMLLM algorithm 3 -----------------------------

// Permutation batch -> rank minimizing the largest per-source-rank off-node send volume
// (greedy assignment of batches to nodes plus swap local search), then ranks within each node
// chosen to keep the most tokens in place.
std::vector<Index> node_permutation(const int64_t* lengths, Index n, const Index* batch, const Index* src,
                                    Index num_ranks, Index ranks_per_node, Index max_iters);

// Within-node step only: given batch -> node, choose batch -> rank.
std::vector<Index> place_within_nodes(const int64_t* lengths, Index n, const Index* batch, const Index* src,
                                      Index num_ranks, Index ranks_per_node,
                                      const std::vector<Index>& node_of_batch);

}  // namespace mmb
