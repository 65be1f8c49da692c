// Plans for a data-parallel batch sampler with gradient accumulation: every optimizer step's
// examples split into `g` micro-batches on each of `d` ranks.
#pragma once

#include <cstdint>

#include "costs.hpp"

namespace mmb {

// Plan `steps` consecutive steps of `n` examples each (`lengths` holds steps * n lengths, step by
// step). A micro-batch costs batch_cost(cm, ...) of its examples: with `padded`, `cm` must be
// Padded or PaddedQuadratic (count * h(longest)); otherwise Sum or Quadratic (additive).
//
// Ranks synchronize every micro-batch, so a step costs the sum over its micro-batch slots of the
// slowest rank's micro-batch. Per step the planner fills slots from the longest examples down:
// while the longest remaining example outweighs an even share of what is left, the next slot's
// level is that example's cost and its `d` micro-batches are filled up to it; the rest is split
// into d * (slots left) micro-batches of even cost (additive: LPT and a move/swap search; padded:
// the exact min-max split into runs of the length order), grouped by cost into slots. Every slot's
// micro-batches go to ranks so the step totals stay even. With n >= d * g no micro-batch is empty.
//
// Writes rank[i], micro[i] (the slot, 0..g-1) per example and costs[(s * g + k) * d + r], the cost
// of rank r's k-th micro-batch in step s. Deterministic: identical inputs, identical outputs.
void plan_accum(const int64_t* lengths, Index steps, Index n, Index d, Index g, const CostModel& cm, bool padded,
                Index* rank, Index* micro, double* costs);

}  // namespace mmb
