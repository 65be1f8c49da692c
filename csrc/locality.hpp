// Locality-aware balancing: plans that keep examples on their source rank unless balance needs
// the move, and send the rest to node-mates first (beyond OrchMLLM, which permutes whole batches).
#pragma once

#include <vector>

#include "costs.hpp"

namespace mmb {

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

}  // namespace mmb
