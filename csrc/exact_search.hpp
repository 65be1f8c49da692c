// A budgeted branch and bound for small plain instances (a few dozen examples over a few ranks),
// where heuristics can miss the optimum by percents: it looks for a plan strictly better than a
// given one and usually proves the optimum within its budget.
#pragma once

#include <cstdint>
#include <vector>

#include "costs.hpp"

namespace mmb {

// Branch and bound for a plan strictly better than `dst` within `budget` nodes; replaces `dst` and
// returns true if it finds one. Deterministic (the budget counts nodes, not time).
bool improve_small(const int64_t* lengths, Index n, Index num_ranks, const CostModel& cm, std::vector<Index>& dst,
                   int64_t budget);

}  // namespace mmb
