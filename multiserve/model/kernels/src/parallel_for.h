// parallel_for: the one work-distribution loop of multiserve's native kernels.
//
// Items [0, items) are handed out in chunks of `chunk` from one atomic counter to the
// calling thread and `helpers` tasks scheduled on XLA's intra-op pool; the call returns
// when every item is done. The caller works too, so the call finishes even when no pool
// thread is free. The shared state (the body and the counters) lives in a shared_ptr that
// each task holds, so a helper that starts after the call returned only finds the counter
// exhausted and touches nothing else. Which thread runs an item never changes what the
// item computes: the kernels' results do not depend on the split.

#ifndef MULTISERVE_NATIVE_PARALLEL_FOR_H_
#define MULTISERVE_NATIVE_PARALLEL_FOR_H_

#include <algorithm>
#include <atomic>
#include <cstdint>
#include <memory>
#include <thread>
#include <utility>

#include "xla/ffi/api/ffi.h"

namespace multiserve {

// body(begin, end) computes items [begin, end); it is copied into the shared state.
template <typename Body>
void parallel_for(xla::ffi::ThreadPool& pool, int64_t items, int64_t chunk, int64_t helpers,
                  Body body) {
  struct State {
    State(Body b, int64_t n, int64_t c) : body(std::move(b)), items(n), chunk(c) {}
    Body body;
    int64_t items, chunk;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
  };
  auto st = std::make_shared<State>(std::move(body), items, std::max<int64_t>(1, chunk));
  auto work = [](State& s) {
    for (;;) {
      const int64_t start = s.next.fetch_add(s.chunk);
      if (start >= s.items) return;
      const int64_t stop = std::min(s.items, start + s.chunk);
      s.body(start, stop);
      s.done.fetch_add(stop - start);
    }
  };
  for (int64_t i = 0; i < helpers; ++i) pool.Schedule([st, work] { work(*st); });
  work(*st);
  while (st->done.load() < st->items) std::this_thread::yield();
}

}  // namespace multiserve

#endif  // MULTISERVE_NATIVE_PARALLEL_FOR_H_
