// Two-sided work on a long-lived helper thread (internal helper).
#pragma once

#include <functional>

namespace mmb {

// Runs `side` on a process-wide helper thread while the calling thread runs `main`, and returns
// when both have finished. The helper lives as long as the process (a child process after fork
// starts its own), so its per-thread scratch buffers (scratch.hpp) are reused from call to call:
// a fresh thread would allocate and page-fault tens of megabytes on every plan. While another
// caller holds the helper, `side` runs on a thread of its own instead. The two may wait on each
// other. An exception from either is rethrown here once both have finished (the side's first);
// a side that can stop early must release whatever the other waits for.
void run_beside(const std::function<void()>& side, const std::function<void()>& main);

}  // namespace mmb
