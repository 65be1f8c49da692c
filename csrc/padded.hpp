// Exact planners for padded batch costs, count * h(max length) ("padded", "padded_quadratic"),
// and OrchMLLM's algorithm 2 for reference.
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

// Exact min-max "padded" partition (count * max length) into at most num_ranks groups.
std::vector<Index> padded_optimal(const int64_t* lengths, Index n, Index num_ranks);

// OrchMLLM algorithm 2 (ascending greedy + binary search), for reference and benchmarks.
std::vector<Index> paper_padded(const int64_t* lengths, Index n, Index num_ranks);

// Exact min-max partition for a batch cost count * h(max length) ("padded", "padded_quadratic").
std::vector<Index> padded_general_optimal(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm);

}  // namespace mmb
