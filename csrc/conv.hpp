// Planners for the "conv" cost (alpha * sum l + beta * b * (max l)^2): OrchMLLM's algorithm 5, the
// optimal partition of the length-sorted order into runs, a local search on the true cost, and
// the planner that picks the best of them.
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

// "conv" from its candidates (the paper's algorithm 5, LPT, the best runs, the padded optimum),
// each refined by `iters` local-search steps: destination of each example.
std::vector<Index> balance_conv(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm, Index iters);

// OrchMLLM algorithm 5 (long sequences grouped under the sum bound, the rest by LPT).
// `order` (lengths descending, ties by index) and `lpt_sums` (LPT on the lengths in that order),
// if the caller has them.
std::vector<Index> paper_conv(const int64_t* lengths, Index n, Index num_ranks,
                              const std::vector<Index>* order = nullptr, const std::vector<Index>* lpt_sums = nullptr);

// Optimal partition of the length-sorted order into at most num_ranks runs (a "conv" candidate).
// Within 2^-20 of the optimum over such partitions. `order`: as for paper_conv.
std::vector<Index> conv_runs(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                             const std::vector<Index>* order = nullptr);

// General local search under any cost model (used for "conv"); never raises the makespan.
// `order`: the examples by length descending, ties by index, if the caller has it.
void refine_general(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                    std::vector<Index>& dst, Index max_iters, const std::vector<Index>* order = nullptr);

// A lower bound on the makespan refine_general reaches from `dst` in `max_iters` steps: a step
// changes two ranks, so one of the 2 max_iters + 1 costliest keeps its cost. -inf when every rank
// may change.
double refine_floor(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm,
                    const std::vector<Index>& dst, Index max_iters);

}  // namespace mmb
