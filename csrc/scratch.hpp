// Per-thread scratch buffers (internal helper).
#pragma once

#include <cstddef>
#include <vector>

namespace mmb {

// A per-thread buffer of at least n elements that only grows: one per (type, tag). Planning runs
// every step on the same sizes; reusing the memory avoids the page faults of fresh multi-megabyte
// allocations, which cost as much as the planning itself once an allocator returns large blocks
// to the OS (as it does in a process that has imported torch). Contents are unspecified.
template <class T, int Tag>
T* scratch(size_t n) {
  thread_local std::vector<T> buf;
  if (buf.size() < n) buf.resize(n);
  return buf.data();
}

}  // namespace mmb
