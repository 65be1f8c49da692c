// Stable LSD radix sort of records by an integer key (internal helper).
#pragma once

#include <algorithm>
#include <cstddef>
#include <cstdint>
#include <utility>
#include <vector>

namespace mmb {

// Number of significant bits of x.
inline int bit_width(uint64_t x) {
  int b = 0;
  while (x) ++b, x >>= 1;
  return b;
}

// Sorts the m records a[0, m) by key(record), whose significant bits are the low `bits`, 11 bits
// per pass, using b[0, m) as the other buffer. Stable: equal keys keep their order. Returns the
// buffer holding the result (a or b).
template <class T, class Key>
T* radix_sort(T* a, T* b, size_t m, int bits, Key key) {
  constexpr int kDigit = 11;
  constexpr uint64_t kMask = (uint64_t{1} << kDigit) - 1;
  std::vector<size_t> count(size_t{1} << kDigit);
  for (int shift = 0; shift < bits; shift += kDigit) {
    std::fill(count.begin(), count.end(), 0);
    for (size_t k = 0; k < m; ++k) ++count[(static_cast<uint64_t>(key(a[k])) >> shift) & kMask];
    size_t acc = 0;
    for (auto& c : count) {
      const size_t t = c;
      c = acc;
      acc += t;
    }
    for (size_t k = 0; k < m; ++k) b[count[(static_cast<uint64_t>(key(a[k])) >> shift) & kMask]++] = a[k];
    std::swap(a, b);
  }
  return a;
}

}  // namespace mmb
