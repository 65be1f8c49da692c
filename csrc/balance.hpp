// Plain post-balancing (OrchMLLM section 5.1 and appendix A, and improvements on them): the
// dispatcher that picks, per policy, the planners of additive.hpp, padded.hpp, conv.hpp and
// exact_search.hpp. Locality-aware plans are locality.hpp's; the node-wise permutation
// node_perm.hpp's.
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

// Plain balancing (no source information): destination rank of each example.
std::vector<Index> balance(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm);

}  // namespace mmb
