// The node-wise permutation (OrchMLLM algorithm 3): which rank receives which batch, so the
// largest per-rank off-node send is small.
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

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
