// A fault amplifier for scripts/stress_sync.py --align (LD_PRELOAD, CPU test runs only; it changes no result).
//
// torch's ProcessGroupGloo::runLoop, after each work, stores the op's name in the group's status,
// `pgStatus_->lastCompletedWorkName = opTypeToString(work->opType_)`, outside its lock, from each of the group's
// two worker threads. Two works finishing at the same instant race on that std::string; the instant is rare on
// its own. This library interposes c10d::opTypeToString (runLoop calls it through the PLT) and holds a gloo worker
// thread there, up to 300 us, until a second one arrives, so both leave together and run the assignment at the
// same time. Nothing else changes: the real name is returned.
#include <dlfcn.h>
#include <pthread.h>

#include <atomic>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <string>

namespace c10d {
enum class OpType : std::uint8_t;

std::string opTypeToString(OpType op) {
  using Fn = std::string (*)(OpType);
  // torch's own definition: torch is loaded (RTLD_LOCAL) before any collective runs
  static Fn real = reinterpret_cast<Fn>(dlsym(dlopen("libtorch_cpu.so", RTLD_NOW | RTLD_NOLOAD),
                                              "_ZN4c10d14opTypeToStringB5cxx11ENS_6OpTypeE"));
  if (real == nullptr) {
    std::fprintf(stderr, "gloo_align: c10d::opTypeToString not found in libtorch_cpu.so\n");
    std::abort();
  }
  std::string name = real(op);
  char thread[16] = {0};
  pthread_getname_np(pthread_self(), thread, sizeof(thread));
  if (std::strcmp(thread, "pt_gloo_runloop") == 0) {
    static std::atomic<long> arrived{0};
    long pair_done = 2 * ((++arrived + 1) / 2);  // the count at which this thread's pair is complete
    auto t0 = std::chrono::steady_clock::now();
    while (arrived.load() < pair_done && std::chrono::steady_clock::now() - t0 < std::chrono::microseconds(300)) {
    }
  }
  return name;
}
}  // namespace c10d
