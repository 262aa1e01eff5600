// The generic build's matmuls: plain C++ for any CPU the x86 builds do not cover, in the AVX2
// build's layouts (packing.py) and with its arithmetic, one value at a time: int4 (Q4_1) and Q8_0
// weights on 8-bit activations (per row and group of 32 inputs s = max|x| / 127, xq = round(x / s),
// a group's sum of q * xq an exact integer, then acc = fma(sum, d * s, acc) and, Q4_1, acc = fma(lo,
// s * the group's sum of xq, acc), group after group), bf16 weights in fp32 with one fused
// multiply-add a weight in input order. Each step is the AVX2 build's, so both give the same bits
// (tested); a row's operations do not depend on the other rows (batch invariance).
#include "q4.h"

#include <cmath>
#include <limits>

#if defined(__AVX2__)
#error "q4_generic.cpp is the generic build's matmul file (kernels.py compiles it without ISA flags)"
#endif

namespace q4 {
namespace {

// q4.h's Act8 with xq in input order
Act8 act8(const uint16_t* x, int64_t M, int64_t K) {
  const int64_t G = K / 32;
  Act8 a(M, K);
  at::parallel_for(0, M, 1, [&](int64_t m0, int64_t m1) {
    for (int64_t m = m0; m < m1; ++m)
      for (int64_t g = 0; g < G; ++g) {
        const uint16_t* p = x + m * K + g * 32;
        float v[32], mx = 0.f;
        bool bad = false;
        for (int i = 0; i < 32; ++i) {
          v[i] = simd::bf16_value(p[i]);
          bad = bad || std::isnan(v[i]);
          mx = std::max(mx, std::fabs(v[i]));
        }
        float s = mx / 127.f, inv = mx > 0.f ? 127.f / mx : 0.f;
        if (bad || !(mx <= std::numeric_limits<float>::max())) s = std::numeric_limits<float>::quiet_NaN(), inv = 0.f;
        int32_t total = 0;
        for (int i = 0; i < 32; ++i) {
          const float r = v[i] * inv;
          const int32_t n = std::isfinite(r) ? static_cast<int32_t>(std::nearbyint(r)) : 0;  // round to nearest even
          a.q[m * K + g * 32 + i] = static_cast<int8_t>(n);
          total += n;
        }
        a.sum[m * G + g] = s * static_cast<float>(total);
        a.s[m * G + g] = s;
      }
  });
  return a;
}

// weight value of column c (0..15) and input k (0..31) of a column block and group (`block`), as
// packing.py lays them out for this build: int4 octets (inputs (0, 4, 1, 5) of octet o in the low
// nibbles of column c's dword, (2, 6, 3, 7) in the high ones), Q8_0 and bf16 input pairs
inline int q4_value(const uint8_t* p, int64_t block, int c, int k) {
  const int o = k / 8, i = k % 8, word = i % 2, nib = (i / 2) % 2, byte = i / 4;  // input 8o + 4 byte + 2 nib + word
  const uint8_t b = p[(block * 4 + o) * 64 + 4 * c + 2 * word + byte];
  return nib ? b >> 4 : b & 15;
}

template <bool Q4>
torch::Tensor matmul_a8(const torch::Tensor& x, int64_t M, int64_t K, int64_t N, const uint8_t* p, const Scales& D,
                        const Scales& L = Scales()) {
  const int64_t G = K / 32;
  const auto xc = x.contiguous();
  const Act8 a = act8(reinterpret_cast<const uint16_t*>(xc.data_ptr<at::BFloat16>()), M, K);
  auto y = torch::empty(out_shape(xc, N), xc.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    int32_t q[16][32];
    std::vector<float> acc(M * 16);
    for (int64_t cb = b0; cb < b1; ++cb) {
      std::fill(acc.begin(), acc.end(), 0.f);
      for (int64_t g = 0; g < G; ++g) {
        const int64_t block = cb * G + g;
        for (int c = 0; c < 16; ++c)
          for (int k = 0; k < 32; ++k)
            q[c][k] = Q4 ? q4_value(p, block, c, k)
                         : static_cast<int8_t>(p[(block * 16 + k / 2) * 32 + 2 * c + k % 2]);  // Q8_0 pairs
        for (int64_t m = 0; m < M; ++m) {
          const int8_t* xq = a.q.data() + m * K + g * 32;
          const float s = a.s[m * G + g], xs = a.sum[m * G + g];
          for (int c = 0; c < 16; ++c) {
            int32_t t = 0;
            for (int k = 0; k < 32; ++k) t += q[c][k] * xq[k];
            float& r = acc[m * 16 + c];
            r = std::fma(static_cast<float>(t), D.at(block * 16 + c) * s, r);
            if constexpr (Q4) r = std::fma(L.at(block * 16 + c), xs, r);
          }
        }
      }
      for (int64_t m = 0; m < M; ++m)
        for (int c = 0; c < 16; ++c) yp[m * N + cb * 16 + c] = at::BFloat16(acc[m * 16 + c]);
    }
  });
  return y;
}

}  // namespace
}  // namespace q4

using namespace q4;  // the exported functions below use the matmuls above

torch::Tensor q4_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D, torch::Tensor L) {
  return q4_mm_a8(x, P, D, L, matmul_a8<true>);
}

torch::Tensor q8_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) { return q8_mm_a8(x, P, D, matmul_a8<false>); }

// bf16 weights: pair r of a block, 16 columns x 2 values (w[c, 2r], w[c, 2r + 1]); every row adds
// w * x in fp32 in input order
torch::Tensor bf16_mm(torch::Tensor x, torch::Tensor P, torch::Tensor D) {
  const auto shape = packed_shape("bf16_mm", x, P, torch::kBFloat16, 16, {D});
  const int64_t M = shape[0], K = shape[1], N = shape[2], G = K / 32;
  const auto xc = x.contiguous();
  const auto xf = xc.to(torch::kFloat);
  const float* xp = xf.data_ptr<float>();
  const auto* p = reinterpret_cast<const uint16_t*>(P.data_ptr<at::BFloat16>());
  auto y = torch::empty(out_shape(xc, N), xc.options());
  auto* yp = y.data_ptr<at::BFloat16>();
  at::parallel_for(0, N / 16, 1, [&](int64_t b0, int64_t b1) {
    for (int64_t cb = b0; cb < b1; ++cb)
      for (int64_t m = 0; m < M; ++m)
        for (int c = 0; c < 16; ++c) {
          float acc = 0.f;
          for (int64_t g = 0; g < G; ++g)
            for (int k = 0; k < 32; ++k) {
              const uint16_t w = p[((cb * G + g) * 16 + k / 2) * 32 + 2 * c + k % 2];
              acc = std::fma(simd::bf16_value(w), xp[m * K + g * 32 + k], acc);
            }
          yp[m * N + cb * 16 + c] = at::BFloat16(acc);
        }
  });
  return y;
}
