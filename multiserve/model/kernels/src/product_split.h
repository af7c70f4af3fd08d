// How multiserve's native products (row_gemm.cc, row_gemm_bf16.cc) spread their work items
// over XLA's intra-op pool. Which thread runs an item never changes what it computes.

#ifndef MULTISERVE_NATIVE_PRODUCT_SPLIT_H_
#define MULTISERVE_NATIVE_PRODUCT_SPLIT_H_

#include <algorithm>
#include <cstdint>

#include "parallel_for.h"
#include "xla/ffi/api/ffi.h"

namespace multiserve {

// How the products use this machine: measured per machine by native.py (`product_tuning`,
// from the read rates of one and two threads) and set once per process before any product
// runs (MultiserveSetProductTuning, row_gemm.cc). Neither changes a result: they decide
// only which thread reads which panel and what is prefetched.
struct ProductTuning {
  // a product of fewer work units runs on the calling thread alone (for_each_item)
  int64_t split_units = 1 << 12;
  // a one-register-block product prefetches its weight stream this many bytes ahead of the
  // panel row it reads (0: the hardware prefetcher alone)
  int64_t ahead_bytes = 0;
};
inline ProductTuning& product_tuning() {
  static ProductTuning tuning;
  return tuning;
}

// A product's size in units of 64 multiply-adds (a panel row times a row of x).
inline int64_t work_units(int64_t panels, int64_t m, int64_t k) {
  return panels * std::max<int64_t>(1, m) * k;
}

// Runs run(b, e) over the work items [0, items) on the pool. `contiguous`: each thread one
// contiguous run of items (a thread that finishes early takes a run not yet started), so
// the panel a block warms while it works (run_block) is the one its thread runs next;
// otherwise ~4 grabs per thread, which evens out a thread that starts late or is preempted
// (the host's own work shares these cores). A small product (`units`, its work_units, under
// the machine's `split_units`) stays on the caller. A 1-row product is a stream of its
// weights from memory, which two cores stream faster than one where one core alone does
// not reach the machine's bandwidth (docs/performance.md §3, §32).
template <typename Run>
void for_each_item(xla::ffi::ThreadPool& pool, int64_t items, int64_t units, bool contiguous,
                   Run run) {
  const int64_t threads = std::max<int64_t>(1, pool.num_threads());
  const int64_t helpers = units < product_tuning().split_units ? 0 : std::min(threads, items) - 1;
  const int64_t chunk = contiguous ? std::max<int64_t>(1, (items + helpers) / (helpers + 1))
                                   : std::max<int64_t>(1, items / ((helpers + 1) * 4));
  parallel_for(pool, items, chunk, helpers, run);
}

}  // namespace multiserve

#endif  // MULTISERVE_NATIVE_PRODUCT_SPLIT_H_
