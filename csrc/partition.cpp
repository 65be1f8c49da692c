// Balanced pipeline partition (OmniBal section 4.2) and adaptive resource allocation (MMScale section 4.3,
// DistTrain section 5.1-5.2).
//
// Partition: the paper ranks jittered candidates around a greedy anchor by VAR(fwd) + SUM(comm)
// (eqs. 4-5). The stage mean is fixed by the total, so VAR = sum S_i^2 - N mean^2 is additive over
// stages and the communication term over cuts: the paper's metric is minimized exactly over all
// partitions by a DP over (stages, layers). The candidate set given to the user is that optimum
// plus the paper's own candidates, ranked by the same metric (balancing/partition.py).
//
// Allocation: for fixed TP/DP sizes the paper solves a convex relaxation in the GPU counts; here
// the PP sizes are integers and the bottleneck max_m w_m / PP_m is minimized exactly by giving one
// more stage to the bottleneck module while the GPUs last.
#include <algorithm>
#include <cmath>
#include <limits>

#include "schedulers.hpp"

namespace mmb {

namespace {

constexpr double kInf = std::numeric_limits<double>::infinity();

std::vector<double> prefix(const double* x, Index L) {
  std::vector<double> p(L + 1, 0.0);
  for (Index i = 0; i < L; ++i) p[i + 1] = p[i] + x[i];
  return p;
}

// Generic DP over cuts: cost(i, j) of a stage of layers [i, j) plus cut(i) for a cut before layer
// i (i > 0); combine = sum or max. Returns the boundaries b[1..N-1].
template <class Stage, class Cut>
std::vector<Index> cut_dp(Index L, Index N, Stage stage, Cut cut, bool use_max) {
  const Index w = L + 1;
  std::vector<double> dp(static_cast<size_t>(N + 1) * w, kInf);
  std::vector<Index> arg(static_cast<size_t>(N + 1) * w, 0);
  dp[0] = 0.0;
  for (Index k = 1; k <= N; ++k) {
    for (Index j = k; j <= L - (N - k); ++j) {
      for (Index i = k - 1; i < j; ++i) {
        const double prev = dp[(k - 1) * w + i];
        if (!std::isfinite(prev)) continue;
        const double c = stage(i, j) + (i > 0 ? cut(i) : 0.0);
        const double v = use_max ? std::max(prev, c) : prev + c;
        if (v < dp[k * w + j]) {
          dp[k * w + j] = v;
          arg[k * w + j] = i;
        }
      }
    }
  }
  std::vector<Index> b(N + 1);
  b[N] = L;
  for (Index k = N; k >= 1; --k) b[k - 1] = arg[k * w + b[k]];
  return std::vector<Index>(b.begin() + 1, b.end() - 1);
}

}  // namespace

std::vector<Index> partition_dp(const double* fwd, const double* act, Index L, Index stages, double comm_weight) {
  const auto p = prefix(fwd, L);
  return cut_dp(
      L, stages, [&](Index i, Index j) { return (p[j] - p[i]) * (p[j] - p[i]); },
      [&](Index i) { return comm_weight * act[i - 1]; }, false);
}

std::vector<Index> partition_minmax(const double* fwd, Index L, Index stages) {
  const auto p = prefix(fwd, L);
  return cut_dp(
      L, stages, [&](Index i, Index j) { return p[j] - p[i]; }, [](Index) { return 0.0; }, true);
}

std::vector<Index> partition_greedy(const double* fwd, Index L, Index stages) {
  const auto p = prefix(fwd, L);
  std::vector<Index> b;
  Index prev = 0;
  for (Index k = 1; k < stages; ++k) {
    const double target = p[L] * static_cast<double>(k) / static_cast<double>(stages);
    // first cut whose prefix reaches the target, moved back one layer if that is closer
    Index j = prev + 1;
    while (j < L - (stages - k) && p[j] < target) ++j;
    if (j - 1 > prev && std::abs(p[j - 1] - target) <= std::abs(p[j] - target)) --j;
    b.push_back(j);
    prev = j;
  }
  return b;
}

std::vector<AllocChoice> allocate(const std::vector<ModuleSpec>& modules, Index llm,
                                  const std::vector<Index>& tp_options, Index batch, Index num_gpus, double capacity,
                                  Index top_k, bool relaxed) {
  const Index M = static_cast<Index>(modules.size());
  const Index T = static_cast<Index>(tp_options.size());
  std::vector<Index> div_batch;
  for (Index d = 1; d <= batch; ++d)
    if (batch % d == 0) div_batch.push_back(d);
  std::vector<AllocChoice> out;
  if (top_k < 1) return out;
  std::vector<Index> tpi(M, 0), dp(M, 1), pp(M, 1), pmin(M, 1);
  std::vector<double> wgt(M);
  // one (TP, DP) choice: exact PP sizes, then the iteration time
  auto evaluate = [&](Index dp_llm) {
    Index units = 0;
    for (Index m = 0; m < M; ++m) {
      const ModuleSpec& ms = modules[m];
      const Index tp = tp_options[tpi[m]];
      const double c = ms.time[tpi[m]];
      if (!std::isfinite(c)) return;
      const double mb = static_cast<double>(dp_llm / dp[m]);
      wgt[m] = mb * c;
      pmin[m] = 1;
      if (capacity > 0) {
        const double room = capacity - mb * ms.activation / tp;
        if (room <= 0) return;
        const double need = (ms.params / tp + ms.optimizer / (tp * dp[m])) / room;
        pmin[m] = std::max<Index>(1, static_cast<Index>(std::ceil(need - 1e-12)));
      }
      if (pmin[m] > ms.max_pp) return;
      pp[m] = pmin[m];
      units += tp * dp[m] * pp[m];
    }
    if (units > num_gpus) return;
    if (relaxed) {
      // the paper: continuous stage counts balancing w_m / PP_m under the GPU budget (bisection
      // on the common stage time), then rounded down
      auto used = [&](double tau) {
        double u = 0.0;
        for (Index m = 0; m < M; ++m) {
          const double x = std::min<double>(modules[m].max_pp, std::max<double>(pmin[m], wgt[m] / tau));
          u += x * tp_options[tpi[m]] * dp[m];
        }
        return u;
      };
      double lo = 0.0, hi = 0.0;
      for (Index m = 0; m < M; ++m) hi = std::max(hi, wgt[m] / pmin[m]);
      if (hi > 0) {
        lo = hi * 1e-12;
        for (int it = 0; it < 100; ++it) {
          const double mid = 0.5 * (lo + hi);
          if (used(mid) > num_gpus) lo = mid; else hi = mid;
        }
        units = 0;
        for (Index m = 0; m < M; ++m) {
          const double x = std::min<double>(modules[m].max_pp, std::max<double>(pmin[m], wgt[m] / hi));
          pp[m] = std::max<Index>(pmin[m], static_cast<Index>(std::floor(x + 1e-9)));
          units += tp_options[tpi[m]] * dp[m] * pp[m];
        }
        if (units > num_gpus) return;
      }
    } else {
      for (;;) {
        Index top = 0;
        for (Index m = 1; m < M; ++m)
          if (wgt[m] / pp[m] > wgt[top] / pp[top]) top = m;
        const Index unit = tp_options[tpi[top]] * dp[top];
        if (pp[top] + 1 > modules[top].max_pp || units + unit > num_gpus) break;
        ++pp[top];
        units += unit;
      }
    }
    AllocChoice ch;
    double bottleneck = 0.0;
    ch.warmup = 0.0;
    for (Index m = 0; m < M; ++m) {
      bottleneck = std::max(bottleneck, wgt[m] / pp[m]);
      ch.warmup += wgt[m];
      ch.tp.push_back(tp_options[tpi[m]]);
    }
    ch.dp = dp;
    ch.pp = pp;
    ch.steady = bottleneck * static_cast<double>(batch / dp_llm - 1);
    ch.iter_time = ch.warmup + ch.steady;
    ch.gpus = units;
    auto better = [](const AllocChoice& a, const AllocChoice& b) {
      if (a.iter_time != b.iter_time) return a.iter_time < b.iter_time;
      return a.gpus < b.gpus;
    };
    if (static_cast<Index>(out.size()) == top_k && !better(ch, out.back())) return;
    auto pos = std::upper_bound(out.begin(), out.end(), ch, better);  // after equals: enumeration order
    out.insert(pos, std::move(ch));
    if (static_cast<Index>(out.size()) > top_k) out.pop_back();
  };
  // enumerate TP per module (odometer), DP_llm | batch, DP_m | DP_llm
  std::vector<Index> dpi(M, 0);
  for (;;) {
    for (Index dl : div_batch) {
      std::vector<Index> div_llm;
      for (Index d = 1; d <= dl; ++d)
        if (dl % d == 0) div_llm.push_back(d);
      std::fill(dpi.begin(), dpi.end(), 0);
      for (;;) {
        for (Index m = 0; m < M; ++m) dp[m] = m == llm ? dl : div_llm[dpi[m]];
        evaluate(dl);
        Index m = 0;
        for (; m < M; ++m) {
          if (m == llm) continue;
          if (++dpi[m] < static_cast<Index>(div_llm.size())) break;
          dpi[m] = 0;
        }
        if (m == M) break;
      }
    }
    Index m = 0;
    for (; m < M; ++m) {
      if (++tpi[m] < T) break;
      tpi[m] = 0;
    }
    if (m == M) break;
  }
  return out;
}

}  // namespace mmb
