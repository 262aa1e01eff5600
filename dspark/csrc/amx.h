// AMX tiles where the CPU and the OS allow them: the CPU's flags (CPUID), the OS's permission for the
// tile state (Linux asks each process to request it: arch_prctl ARCH_REQ_XCOMP_PERM), and one tile
// configuration (eight 16 x 64-byte tiles). What a kernel built with -mamx-tile -mamx-bf16 checks once
// before its first tile instruction; anywhere else it runs its AVX-512 path, and `why` says why.
#pragma once
#include <cstdint>
#include <string>

#if defined(__AMX_TILE__) && defined(__AMX_BF16__) && defined(__linux__)
#include <cpuid.h>
#include <immintrin.h>
#include <sys/syscall.h>
#include <unistd.h>
#define DSPARK_AMX 1
#endif

namespace amx {

// whether this process may run tiles at all: dspark's `kernels` choice (kernels.py: "avx512" keeps the
// AVX-512 paths on a CPU that has AMX), set through the module's amx_off() before any kernel runs
inline bool& allowed() {
  static bool a = true;
  return a;
}

struct State {
  bool ok = false;
  std::string why;
};

#if defined(DSPARK_AMX)
inline State probe() {
  State s;
  if (!allowed()) {
    s.why = "switched off (kernels avx512)";
    return s;
  }
  unsigned a, b, c, d;
  if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 24)) || !(d & (1u << 22))) {
    s.why = "the CPU has no AMX-BF16";
    return s;
  }
  constexpr long ARCH_REQ_XCOMP_PERM = 0x1023, XFEATURE_XTILEDATA = 18;
  if (syscall(SYS_arch_prctl, ARCH_REQ_XCOMP_PERM, XFEATURE_XTILEDATA) != 0) {
    s.why = "the OS refused the AMX tile state (arch_prctl ARCH_REQ_XCOMP_PERM; Linux 5.16+ grants it)";
    return s;
  }
  s.ok = true;
  s.why = "AMX-BF16";
  return s;
}
#endif

// once a process: may this process run AMX-BF16 tiles, and if not, why
inline const State& state() {
#if defined(DSPARK_AMX)
  static const State s = probe();
#else
  static const State s = {false, "this build has no AMX code"};
#endif
  return s;
}

#if defined(DSPARK_AMX)
// palette 1, all eight tiles 16 rows of 64 bytes (16 fp32 or 32 bf16 a row); a thread loads it before
// its first tile instruction and releases the tiles after its last
struct alignas(64) Config {
  uint8_t palette = 1, start_row = 0, reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
  Config() {
    for (int t = 0; t < 8; ++t) colsb[t] = 64, rows[t] = 16;
  }
};

struct Tiles {  // RAII: the configuration loaded for this thread's scope
  Tiles() {
    static const Config cfg;
    _tile_loadconfig(&cfg);
  }
  ~Tiles() { _tile_release(); }
};
#endif

}  // namespace amx
