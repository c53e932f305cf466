// What the kernel (sort_conv_kernel.h) takes from the program it runs in: checks that fail with a message, the
// number of threads and a parallel loop. Two hosts, chosen by a macro:
//   * PyTorch (the default: the extension of sort_conv_cpu.cpp): TORCH_CHECK, at::get_num_threads and
//     at::parallel_for, exactly as the kernel called them before this header;
//   * a program without libtorch (TIMM_SORTCONV_STANDALONE: the onnxruntime operator of onnxruntime/sort_conv_op.cpp):
//     a failed check throws std::runtime_error, and the threads and the loop are those of a Pool that the caller
//     installs for the duration of a call (PoolScope), which runs the loop's chunks on its own threads
//     (onnxruntime's intra-op thread pool); without one installed the kernel runs on the calling thread.
#pragma once

#include <cstdint>

#if defined(TIMM_SORTCONV_STANDALONE)

#include <algorithm>
#include <exception>
#include <mutex>
#include <sstream>
#include <stdexcept>

namespace timm_sortconv_host {

template <typename... Args>
[[noreturn]] inline void fail(const Args&... args) {
  std::ostringstream message;
  (message << ... << args);
  throw std::runtime_error(message.str());
}

// A thread pool as the kernel uses it: `threads` workers at most, and `run(context, count, task, state)`, which
// calls task(state, i) once for every i in [0, count), concurrently, and returns when all are done.
struct Pool {
  int64_t threads = 1;
  void* context = nullptr;
  void (*run)(void* context, int64_t count, void (*task)(void* state, int64_t i), void* state) = nullptr;
};

inline const Pool*& current_pool() {
  static thread_local const Pool* pool = nullptr;
  return pool;
}

// Installs `pool` for the kernel calls made on this thread while the scope lives.
class PoolScope {
 public:
  explicit PoolScope(const Pool* pool) : previous_(current_pool()) { current_pool() = pool; }
  ~PoolScope() { current_pool() = previous_; }
  PoolScope(const PoolScope&) = delete;
  PoolScope& operator=(const PoolScope&) = delete;

 private:
  const Pool* previous_;
};

// The least multiply-adds a thread of the kernel is started for. A runtime's pool has its threads waiting (onnxruntime's
// spin), so a part costs a few microseconds to hand out: a quarter of PyTorch's threshold. Measured in onnxruntime,
// two threads, one image: the first layer of scnn_p_align_7_guided (1 -> 32 channels, 28 x 28, k = 7, 1.2 million
// multiply-adds) 0.080 -> 0.050 ms split in two, where PyTorch's threshold kept it on one thread.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 18;

inline int64_t num_threads() {
  const Pool* pool = current_pool();
  return pool != nullptr && pool->run != nullptr ? std::max<int64_t>(1, pool->threads) : 1;
}

// at::parallel_for's contract: fn(begin, end) over chunks of [begin, end) of at least `grain` items, one chunk per
// thread at most; an exception thrown by a chunk is rethrown here (the first one), never inside the pool.
template <typename F>
void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  if (begin >= end) return;
  const int64_t items = end - begin, least = std::max<int64_t>(grain, 1);
  const int64_t chunks = std::min(num_threads(), (items + least - 1) / least);
  if (chunks <= 1) {
    fn(begin, end);
    return;
  }
  struct State {
    const F* fn;
    int64_t begin, items, chunks;
    std::mutex lock;
    std::exception_ptr error;
  } state{&fn, begin, items, chunks, {}, nullptr};
  const Pool* pool = current_pool();
  pool->run(pool->context, chunks, [](void* opaque, int64_t i) {
    State& s = *static_cast<State*>(opaque);
    const PoolScope inline_loops(nullptr);  // a loop inside a chunk runs on the chunk's thread
    try {
      (*s.fn)(s.begin + s.items * i / s.chunks, s.begin + s.items * (i + 1) / s.chunks);
    } catch (...) {
      std::lock_guard<std::mutex> guard(s.lock);
      if (!s.error) s.error = std::current_exception();
    }
  }, &state);
  if (state.error) std::rethrow_exception(state.error);
}

}  // namespace timm_sortconv_host

#define TIMM_SORTCONV_CHECK(condition, ...)                              \
  do {                                                                   \
    if (!(condition)) ::timm_sortconv_host::fail(__VA_ARGS__);           \
  } while (false)

#else

#include <ATen/Parallel.h>
#include <c10/util/Exception.h>

namespace timm_sortconv_host {

// The least multiply-adds a thread of the kernel is started for: smaller calls run inline, away from OpenMP's
// start-up and spin costs.
constexpr int64_t kMinWorkPerThread = int64_t(1) << 20;

inline int64_t num_threads() { return at::get_num_threads(); }

template <typename F>
inline void parallel_for(int64_t begin, int64_t end, int64_t grain, const F& fn) {
  at::parallel_for(begin, end, grain, fn);
}

}  // namespace timm_sortconv_host

#define TIMM_SORTCONV_CHECK(condition, ...) TORCH_CHECK(condition, __VA_ARGS__)

#endif
