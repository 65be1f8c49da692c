// Plain post-balancing (balance.hpp): LPT with local search and largest differencing for the
// additive costs (better than algorithms 1 and 4), the exact padded partitions (better than
// algorithm 2), the "conv" candidates (better than algorithm 5), and a branch and bound on small
// instances.
#include "balance.hpp"

#include <algorithm>
#include <stdexcept>

#include "additive.hpp"
#include "conv.hpp"
#include "exact_search.hpp"
#include "helper_thread.hpp"
#include "padded.hpp"
#include "scratch.hpp"

namespace mmb {

namespace {
constexpr Index kSearchMaxItems = 64, kSearchMaxRanks = 16;
constexpr int64_t kSearchBudget = 200000;
constexpr Index kDifferencingMaxItems = 4096, kDifferencingMaxWork = 1 << 15;
constexpr Index kBesideItems = 100000;  // from here two candidates are built on two threads

// Within 1e-4 of the additive lower bound: nothing left worth a costlier candidate.
bool near_bound(const double* w, Index n, Index d, double makespan) {
  double total = 0.0, wmax = 0.0;
  for (Index i = 0; i < n; ++i) total += w[i], wmax = std::max(wmax, w[i]);
  return makespan <= std::max(wmax, total / static_cast<double>(d)) * (1.0 + 1e-4);
}
}  // namespace

std::vector<Index> balance(const int64_t* lengths, Index n, Index d, const CostModel& cm) {
  if (d < 1) throw std::invalid_argument("num_ranks must be >= 1");
  if (n == 0) return {};
  if (d == 1) return std::vector<Index>(n, 0);
  // Each local-search step costs O(b log b + log d); the budget keeps planning within a few
  // milliseconds at thousands of ranks (where LPT is already within ~1e-4 of the bound) and lets
  // small clusters, where the LPT tail matters most, search longer.
  const Index iters = std::min<Index>(4 * d + 64, std::max<Index>(32, 4000000 / std::max<Index>(n, 1)));
  // Few examples over few ranks: heuristics can miss the optimum by percents there, and a bounded
  // branch and bound (at most a few milliseconds) usually closes the gap.
  const bool small = n <= kSearchMaxItems && d <= kSearchMaxRanks;
  switch (cm.policy) {
    case Policy::Sum:
    case Policy::Quadratic: {
      const auto order = order_by_length_desc(lengths, n);
      double* w = scratch<double, 4>(n);
      for (Index i = 0; i < n; ++i) w[i] = item_weight(lengths[i], cm);
      std::vector<Index> best;
      auto first = [&] {
        best = lpt(w, order, d);
        refine_additive(w, n, d, best, iters);
      };
      if (cm.policy == Policy::Quadratic && cm.beta != 0.0) {
        // Algorithm 4 with a zero tolerance interval is LPT on plain sums: keep it as a candidate
        // (built beside the first on large problems: they are independent).
        std::vector<Index> alt;
        double alt_cost = 0.0;
        auto second = [&] {
          double* s = scratch<double, 11>(static_cast<size_t>(n));  // per thread, reused
          for (Index i = 0; i < n; ++i) s[i] = static_cast<double>(lengths[i]);
          alt = lpt(s, order, d);
          refine_additive(w, n, d, alt, iters);
          alt_cost = max_cost(lengths, n, alt, d, cm);
        };
        if (n >= kBesideItems)
          run_beside(second, first);
        else
          first(), second();
        if (alt_cost < max_cost(lengths, n, best, d, cm)) best.swap(alt);
      } else {
        first();
      }
      if (small || (n <= kDifferencingMaxItems && n * d <= kDifferencingMaxWork &&
                    !near_bound(w, n, d, max_cost(lengths, n, best, d, cm)))) {
        // many examples per rank: differencing often finds a near-perfect split that LPT misses
        auto alt = largest_differencing(w, n, d);
        refine_additive(w, n, d, alt, iters);
        if (max_cost(lengths, n, alt, d, cm) < max_cost(lengths, n, best, d, cm)) best.swap(alt);
      }
      if (small) improve_small(lengths, n, d, cm, best, kSearchBudget);
      return best;
    }
    case Policy::Padded:
      return padded_optimal(lengths, n, d);
    case Policy::PaddedQuadratic:
      return padded_general_optimal(lengths, n, d, cm);
    case Policy::Conv: {
      auto best = balance_conv(lengths, n, d, cm, std::min<Index>(iters, 1024));
      if (small) improve_small(lengths, n, d, cm, best, kSearchBudget);
      return best;
    }
  }
  throw std::invalid_argument("unknown policy");
}

}  // namespace mmb
