// A long-lived helper thread for two-sided planning work (see helper_thread.hpp).
#include "helper_thread.hpp"

#include <condition_variable>
#include <exception>
#include <mutex>
#include <new>
#include <thread>

#ifndef _WIN32
#include <pthread.h>
#endif

namespace mmb {

namespace {

class Helper {
 public:
  Helper() { std::thread([this] { loop(); }).detach(); }

  std::mutex busy;  // held by the caller using the helper

  // Hands `task` to the helper thread; wait() returns once it has run, with its exception if any.
  void start(const std::function<void()>* task) {
    std::lock_guard<std::mutex> lock(m_);
    task_ = task;
    done_ = false;
    cv_.notify_all();
  }

  std::exception_ptr wait() {
    std::unique_lock<std::mutex> lock(m_);
    cv_.wait(lock, [this] { return done_; });
    return error_;
  }

 private:
  void loop() {
    for (;;) {
      std::unique_lock<std::mutex> lock(m_);
      cv_.wait(lock, [this] { return task_ != nullptr; });
      const auto* task = task_;
      lock.unlock();
      std::exception_ptr error;
      try {
        (*task)();
      } catch (...) {
        error = std::current_exception();
      }
      lock.lock();
      task_ = nullptr;
      error_ = error;
      done_ = true;
      cv_.notify_all();
    }
  }

  std::mutex m_;
  std::condition_variable cv_;
  const std::function<void()>* task_ = nullptr;
  bool done_ = false;
  std::exception_ptr error_;
};

// Never destroyed: the helper thread may still wait on it while the process exits.
std::mutex* g_create = new std::mutex;
Helper* g_helper = nullptr;

#ifndef _WIN32
// A child process has no helper thread and may have copied the locks in any state: start over.
void after_fork_in_child() {
  g_create = new std::mutex;
  g_helper = nullptr;
}
[[maybe_unused]] const bool g_registered = (pthread_atfork(nullptr, nullptr, after_fork_in_child), true);
#endif

Helper& helper() {
  std::lock_guard<std::mutex> lock(*g_create);
  if (!g_helper) g_helper = new Helper;
  return *g_helper;
}

std::exception_ptr run_caught(const std::function<void()>& f) {
  try {
    f();
  } catch (...) {
    return std::current_exception();
  }
  return nullptr;
}

}  // namespace

void run_beside(const std::function<void()>& side, const std::function<void()>& main) {
  Helper& h = helper();
  std::unique_lock<std::mutex> own(h.busy, std::try_to_lock);
  std::exception_ptr side_error, main_error;
  if (own) {
    h.start(&side);
    main_error = run_caught(main);
    side_error = h.wait();
  } else {
    std::thread other([&] { side_error = run_caught(side); });
    main_error = run_caught(main);
    other.join();
  }
  if (side_error) std::rethrow_exception(side_error);
  if (main_error) std::rethrow_exception(main_error);
}

}  // namespace mmb
