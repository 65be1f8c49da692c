// Exact searches for the least feasible bound of a monotone predicate (internal helper).
#pragma once

#include <algorithm>
#include <cstdint>
#include <cstring>
#include <limits>

namespace mmb {

inline int64_t bits_of(double x) {
  int64_t b;
  std::memcpy(&b, &x, sizeof b);
  return b;
}

inline double double_of(int64_t b) {
  double x;
  std::memcpy(&x, &b, sizeof x);
  return x;
}

// galloping up from lo in steps of `step`, 2 step, 4 step ... (a lower bound is usually close to
// the optimum, so few probes are far from it), then bisection of the last gap.
template <class F>
int64_t least_feasible_key(int64_t lo, int64_t hi, int64_t step, F feasible, int64_t width = 0) {
  step = std::max<int64_t>(step, 1);
  while (lo < hi) {
    const int64_t probe = hi - lo > step ? lo + step : hi;
    if (feasible(probe)) {
      hi = probe;
      break;
    }
    lo = probe + 1;
    step = step > (std::numeric_limits<int64_t>::max() >> 2) ? step : 2 * step;
  }
  while (lo < hi && hi - lo > width) {  // `width`: stop once the gap is that narrow, at a feasible key
    const int64_t mid = lo + (hi - lo) / 2;
    if (feasible(mid))
      hi = mid;
    else
      lo = mid + 1;
  }
  return hi;
}

// Smallest double B in [lo, hi] with feasible(B), given feasible(hi). Non-negative finite doubles
// are ordered like their bit patterns, so the search is exact; it starts at lo in relative steps
// of about 2^-10.
template <class F>
double least_feasible(double lo, double hi, F feasible, int64_t width = 0) {
  const int64_t key = least_feasible_key(
      bits_of(lo), bits_of(hi), int64_t{1} << 42, [&](int64_t k) { return feasible(double_of(k)); }, width);
  return double_of(key);
}

}  // namespace mmb
