// Batch costs: the one definition of what a batch of examples costs under each policy.
//
// Everything in csrc is plain C++17 on arrays of example lengths: no Python, no torch. Every
// function is a deterministic pure function of its inputs (ties broken by index, floating-point
// work in one fixed order), so every process that calls it computes byte-identical plans.
#pragma once

#include <cstdint>
#include <vector>

namespace mmb {

using Index = int64_t;

// Cost of one batch with lengths l_1..l_b: Sum = sum l; Padded = b * max l; Quadratic =
// alpha * sum l + beta * sum l^2; Conv = alpha * sum l + beta * b * (max l)^2; PaddedQuadratic =
// alpha * b * max l + beta * b * (max l)^2 (a padded transformer: OrchMLLM eq. 2, padding case).
enum class Policy : int { Sum = 0, Padded = 1, Quadratic = 2, Conv = 3, PaddedQuadratic = 4 };

struct CostModel {
  Policy policy = Policy::Sum;
  double alpha = 1.0;
  double beta = 0.0;
};

// Cost of one batch from its sums: `sum` of lengths, `sq` of squared lengths, `count`, `mx` largest.
double batch_cost(const CostModel& cm, double sum, double sq, double count, double mx);

// Cost of a batch under a policy that ignores squared lengths ("conv" and the padded ones):
// `count` examples, the largest `mx` long, `sum` tokens in all.
inline double run_cost(const CostModel& cm, double sum, double count, double mx) {
  return batch_cost(cm, sum, 0.0, count, mx);
}

// Additive per-example weight for the "sum" and "quadratic" policies.
double item_weight(int64_t length, const CostModel& cm);

// Cost of every rank's batch under `cm` given the destination of each example.
std::vector<double> batch_costs(const int64_t* lengths, Index n, const Index* dst, Index num_ranks,
                                const CostModel& cm);

// The largest of batch_costs.
double max_cost(const int64_t* lengths, Index n, const std::vector<Index>& dst, Index num_ranks,
                const CostModel& cm);

// Indices 0..n-1 sorted by length descending, ties by index ascending (counting or LSD radix
// sort, O(n)): the visiting order of every greedy planner.
std::vector<Index> order_by_length_desc(const int64_t* lengths, Index n);
void order_by_length_desc(const int64_t* lengths, Index n, std::vector<Index>& order);

}  // namespace mmb
