// The kernels' thread team (parallel.h). One job at a time: the caller publishes it under a
// new generation, then every participant claims chunk indices from `ticket` (generation in the
// high 32 bits, next chunk in the low 32) with a compare-and-swap, so a helper that wakes late
// can never claim a chunk of a later job; `done` counts finished chunks. Before the job's
// fields are rewritten the ticket is closed (a value no claim matches), so a helper that read
// the fields and then claimed successfully read them while they were its job's.
// Idle helpers and a waiting caller spin for kSpin, then sleep on a futex (std::atomic::wait).
// Helpers are detached and the team is never freed: nothing runs at process exit.
#include "parallel.h"

#include "pagedllm_abi.h"

#include <omp.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <mutex>
#include <thread>

namespace par {
namespace {

// How long an idle helper (or a caller waiting for a claimed chunk) spins before it sleeps:
// a decode step's parallel regions follow each other within microseconds.
constexpr auto kSpin = std::chrono::microseconds(50);
constexpr uint64_t kClosed = ~uint64_t{0};

inline void relax() {
#if defined(__x86_64__) || defined(__i386__)
  __builtin_ia32_pause();
#elif defined(__aarch64__)
  __asm__ volatile("yield");
#endif
}

// Spins until ready() or kSpin has passed; returns ready().
template <typename Ready>
bool spin(Ready ready) {
  const auto until = std::chrono::steady_clock::now() + kSpin;
  for (;;) {
    for (int i = 0; i < 64; ++i) {
      if (ready()) return true;
      relax();
    }
    if (std::chrono::steady_clock::now() >= until) return ready();
  }
}

struct Team {
  std::mutex busy;  // held by the caller of the running job
  int helpers = 0;  // started helper threads (guarded by busy)
  uint32_t last_generation = 0;  // guarded by busy
  // The job: written by its caller between closing the ticket and publishing the generation.
  std::atomic<Body> body{nullptr};
  std::atomic<const void*> ctx{nullptr};
  std::atomic<int64_t> n{0}, grain{1};
  std::atomic<uint32_t> chunks{0};
  std::atomic<int> members{0};  // helpers 0..members-1 take part
  std::atomic<uint64_t> ticket{kClosed};
  std::atomic<uint32_t> done{0};
  std::atomic<uint32_t> generation{0};  // what idle helpers wait on
  std::atomic<int> sleepers{0};
  std::atomic<bool> caller_asleep{false};
  std::atomic<int64_t> jobs{0};  // jobs run split over threads
};

Team* team = new Team;  // never freed: detached helpers may still be waiting on it at exit
thread_local bool inside = false;  // this thread is running chunks of a job

// Claims and runs chunks of `generation`'s job until none is left.
void work(Team& t, uint32_t generation) {
  for (;;) {
    uint64_t ticket = t.ticket.load();
    if (ticket == kClosed || ticket >> 32 != generation) return;
    const Body body = t.body.load();
    const void* ctx = t.ctx.load();
    const int64_t n = t.n.load(), grain = t.grain.load();
    const uint32_t chunks = t.chunks.load();
    const uint32_t chunk = static_cast<uint32_t>(ticket);
    if (chunk >= chunks) return;
    if (!t.ticket.compare_exchange_weak(ticket, ticket + 1)) continue;
    const int64_t begin = chunk * grain, end = begin + grain < n ? begin + grain : n;
    inside = true;
    body(ctx, begin, end);
    inside = false;
    if (t.done.fetch_add(1) + 1 == chunks && t.caller_asleep.load()) t.done.notify_one();
  }
}

void helper(int index) {
  Team& t = *team;
  uint32_t seen = t.generation.load();
  for (;;) {
    if (!spin([&] { return t.generation.load() != seen; })) {
      t.sleepers.fetch_add(1);
      t.generation.wait(seen);
      t.sleepers.fetch_sub(1);
    }
    seen = t.generation.load();
    if (index < t.members.load()) work(t, seen);
  }
}

void after_fork_in_child() { team = new Team; }  // the parent's helpers do not exist here

}  // namespace

int team_size() { return inside ? 1 : omp_get_max_threads(); }

void run(int64_t n, int64_t grain, Body body, const void* ctx) {
  if (n <= 0) return;
  if (grain < 1) grain = 1;
  const int64_t chunks = (n + grain - 1) / grain;
  const int size = team_size();
  Team& t = *team;
  if (size <= 1 || chunks <= 1 || chunks >= UINT32_MAX || !t.busy.try_lock()) {
    body(ctx, 0, n);
    return;
  }
  static std::once_flag fork_handler;
  std::call_once(fork_handler, [] { pthread_atfork(nullptr, nullptr, after_fork_in_child); });
  for (; t.helpers < size - 1; ++t.helpers) std::thread(helper, t.helpers).detach();

  t.ticket.store(kClosed);
  t.body.store(body);
  t.ctx.store(ctx);
  t.n.store(n);
  t.grain.store(grain);
  t.chunks.store(static_cast<uint32_t>(chunks));
  t.members.store(size - 1);
  t.done.store(0);
  const uint32_t generation = ++t.last_generation == 0 ? ++t.last_generation : t.last_generation;
  t.ticket.store(static_cast<uint64_t>(generation) << 32);
  t.generation.store(generation);
  if (t.sleepers.load() > 0) t.generation.notify_all();
  t.jobs.fetch_add(1, std::memory_order_relaxed);

  work(t, generation);
  const uint32_t all = static_cast<uint32_t>(chunks);
  if (!spin([&] { return t.done.load() == all; })) {
    t.caller_asleep.store(true);
    for (uint32_t d = t.done.load(); d != all; d = t.done.load()) t.done.wait(d);
    t.caller_asleep.store(false);
  }
  t.busy.unlock();
}

}  // namespace par

extern "C" {

int64_t team_jobs(void) { return par::team->jobs.load(std::memory_order_relaxed); }

int64_t probe_team_handoff(int64_t n) {
  const int64_t threads = par::team_size();
  for (int64_t i = 0; i < n; ++i) par::parallel_for(threads, [](int64_t) {}, 2, 1);
  return n;
}

}  // extern "C"
