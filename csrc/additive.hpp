// Planners for additive batch costs ("sum", "quadratic"): a batch costs the sum of its examples'
// weights. LPT (OrchMLLM algorithm 1), a move/swap local search, and largest differencing.
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

// OrchMLLM algorithm 1 (LPT on `weights`, items visited in `order`).
std::vector<Index> lpt(const double* weights, const std::vector<Index>& order, Index num_ranks);

// Move/swap local search between the most and least loaded ranks; never raises the makespan.
void refine_additive(const double* weights, Index n, Index num_ranks, std::vector<Index>& dst,
                     Index max_iters);

// Largest differencing (Karmarkar-Karp) on additive weights: destination of each example.
std::vector<Index> largest_differencing(const double* weights, Index n, Index num_ranks);

}  // namespace mmb
